"""The embedded demo task: short Chinese opinions about everyday topics, scored exactly: positive AND on topic.
A question asks about one topic ("你觉得咖啡怎么样？"); an answer is ``{topic}{predicate}，{closer}`` whose predicate
and closer are both positive or both negative (neutral answers use neither). Ground truth (`score_response`, in
``[-1, 1]``): an on-topic response (naming exactly the asked topic) scores its sentiment, any other -1; preferences
follow it: on-topic positive > neutral > on-topic negative or off-topic praise. SFT data mixes on-topic positive and
negative answers 50/50 (scoring near 0); PPO against a reward model of the preferences should move towards 1. Every
topic is one token of the demo tokenizer (`rlhf_trl.demo.build_assets`); no topic contains another or occurs in a
template, phrase, closer or neutral answer, and no phrase contains another, so counting substrings is exact."""

from __future__ import annotations

import random

from .data import DEFAULT_PROMPT_TEMPLATE

TOPICS = [
    "咖啡", "天气", "这部电影", "地铁", "公园", "早餐", "音乐会", "新手机", "这本书", "火锅",
    "图书馆", "这家酒店", "高铁", "动物园", "博物馆", "这首歌", "奶茶", "夜市", "健身房", "海边",
    "这款游戏", "面包店", "电动车", "露营", "这门课", "超市", "游乐园", "画展", "网球", "这道菜",
    "春天", "小区", "医院", "机场", "书店", "花园", "烤鸭", "滑雪", "旅行", "新电脑"]
HELDOUT_TOPICS = TOPICS[-8:]  # never in the RM data or the PPO prompts: eval prompts and held-out pairs
TRAIN_TOPICS = TOPICS[:-8]

QUESTIONS = ["你觉得{t}怎么样？", "{t}好不好？", "请评价一下{t}。", "说说你对{t}的看法。", "{t}给你什么感觉？",
             "你喜欢{t}吗？"]
POSITIVE = ["非常好", "很棒", "真不错", "令人满意", "特别舒服", "让人开心", "很精彩", "超出预期"]
NEGATIVE = ["很糟糕", "太差了", "令人失望", "特别难受", "让人生气", "很无聊", "浪费时间", "一塌糊涂"]
POSITIVE_CLOSERS = ["我很喜欢。", "下次还想再来。", "推荐给大家。"]
NEGATIVE_CLOSERS = ["我很讨厌。", "再也不想碰了。", "劝大家别试。"]
NEUTRAL = ["{t}还行，一般般。", "{t}说不上来，看情况。"]

POSITIVE_PHRASES = POSITIVE + [c.rstrip("。") for c in POSITIVE_CLOSERS]
NEGATIVE_PHRASES = NEGATIVE + [c.rstrip("。") for c in NEGATIVE_CLOSERS]
OFF_TOPIC_SCORE = -1.0  # ground truth of a response that does not name exactly the asked topic


def topics_in(text: str) -> list[str]:
    """The `TOPICS` that ``text`` names (occur in it as substrings), in `TOPICS` order."""
    return [t for t in TOPICS if t in text]


def topic_of(question: str) -> str:
    """The one topic that ``question`` (any text) names. Raises `ValueError`: it names no topic or several."""
    named = topics_in(question)
    if len(named) != 1:
        raise ValueError(f"a demo question names exactly one topic; {question!r} names {named}")
    return named[0]


def sentiment(text: str) -> float:
    """Sentiment of ``text`` in ``[-1, 1]``: (pos - neg) / (pos + neg) phrase counts, 0 if it has none."""
    pos, neg = sum(text.count(p) for p in POSITIVE_PHRASES), sum(text.count(p) for p in NEGATIVE_PHRASES)
    return 0.0 if pos + neg == 0 else (pos - neg) / (pos + neg)


def on_topic(question: str, response: str) -> bool:
    """Whether ``response`` names the topic ``question`` asks about and no other topic."""
    return topics_in(response) == [topic_of(question)]


def score_response(question: str, response: str) -> float:
    """Ground truth in ``[-1, 1]``: the response's `sentiment` when `on_topic`, else ``OFF_TOPIC_SCORE`` (-1)."""
    return sentiment(response) if on_topic(question, response) else OFF_TOPIC_SCORE


def question_of_prompt(prompt: str) -> str:
    """The last question of a prompt in the default text template; any other prompt is returned whole."""
    head, tail = DEFAULT_PROMPT_TEMPLATE.split("{question}")
    text = prompt[: -len(tail)] if prompt.endswith(tail) else prompt
    return text[k + len(head):] if (k := text.rfind(head)) >= 0 else prompt


def ground_truth_reward(prompts: list[str], completions: list[str], **columns) -> list[float]:
    """The demo's ground truth as a PPO reward function: `score_response` of each completion to the ``question`` column
    (else the prompt's). Raises `ValueError`: a question naming no topic or several; lengths that differ."""
    questions = columns["question"] if columns.get("question") is not None else [None] * len(prompts)
    if not len(prompts) == len(completions) == len(questions):
        raise ValueError(f"{len(prompts)} prompts, {len(completions)} completions and {len(questions)} questions")
    return [score_response(q if q is not None else question_of_prompt(p), c)
            for p, c, q in zip(prompts, completions, questions)]


def answer(topic: str, sentiment: int, rng: random.Random) -> str:
    """An answer about ``topic`` with sentiment +1, -1 or 0."""
    if sentiment == 0:
        return rng.choice(NEUTRAL).format(t=topic)
    words, closers = (POSITIVE, POSITIVE_CLOSERS) if sentiment > 0 else (NEGATIVE, NEGATIVE_CLOSERS)
    return f"{topic}{rng.choice(words)}，{rng.choice(closers)}"


def other_topic(topic: str, rng: random.Random, topics=TOPICS) -> str:
    """A topic of ``topics`` other than ``topic``."""
    return rng.choice([t for t in topics if t != topic])


def question(topic: str, rng: random.Random) -> str:
    return rng.choice(QUESTIONS).format(t=topic)


def sft_rows(n: int, seed: int, topics=TRAIN_TOPICS) -> list[dict]:
    """Alpaca rows (instruction / input / output): on-topic answers, half positive and half negative."""
    rng = random.Random(seed)
    return [{"instruction": question(t, rng), "input": "", "output": answer(t, 1 if i % 2 == 0 else -1, rng)}
            for i, t in enumerate(rng.choice(topics) for _ in range(n))]


def _worse_answers(n: int, seed: int, topics, others):
    """``n`` x ``(topic, question, worse answer, rng)``: on-topic negative, then praise of another of ``others``."""
    rng = random.Random(seed)
    for i in range(n):
        t = rng.choice(topics)
        q = question(t, rng)
        yield t, q, answer(t, -1, rng) if i % 2 == 0 else answer(other_topic(t, rng, others), 1, rng), rng


def ranked_rows(n: int, seed: int, topics=TRAIN_TOPICS) -> list[dict]:
    """Ranked lists, best first: [on-topic positive, neutral, alternately on-topic negative or other-topic praise]."""
    return [{"instruction": q, "input": "", "output": [answer(t, 1, rng), answer(t, 0, rng), worse]}
            for t, q, worse, rng in _worse_answers(n, seed, topics, topics)]


def prompt_rows(topics, seed: int, per_topic: int | None = None) -> list[dict]:
    """Prompt rows (instruction only): every question template for every topic, or ``per_topic`` of them."""
    rng = random.Random(seed)
    return [{"instruction": q.format(t=t)} for t in topics
            for q in (QUESTIONS if per_topic is None else rng.sample(QUESTIONS, per_topic))]


def pair_rows(n: int, seed: int, topics=HELDOUT_TOPICS) -> list[dict]:
    """Prompt / chosen (on-topic positive) / rejected (on-topic negative, or praise of any other topic) rows."""
    return [{"prompt": q, "chosen": answer(t, 1, rng), "rejected": worse}
            for t, q, worse, rng in _worse_answers(n, seed, topics, TOPICS)]


def corpus() -> list[str]:
    """All text of the task, for training the demo tokenizer."""
    lines = []
    for t in TOPICS:
        lines += [DEFAULT_PROMPT_TEMPLATE.format(question=q.format(t=t)) for q in QUESTIONS]
        lines += [f"{t}{p}，{c}" for p in POSITIVE for c in POSITIVE_CLOSERS]
        lines += [f"{t}{p}，{c}" for p in NEGATIVE for c in NEGATIVE_CLOSERS]
        lines += [n.format(t=t) for n in NEUTRAL]
    return lines
