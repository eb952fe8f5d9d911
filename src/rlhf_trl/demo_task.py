"""The embedded demo task: short Chinese opinions about everyday topics, scored exactly by their sentiment.

A question asks about a topic ("你觉得咖啡怎么样？"); an answer is ``{topic}{predicate}，{closer}`` whose predicate
and closer are both positive or both negative (neutral answers use neither). The ground-truth score of any text
is ``(positive phrases - negative phrases) / (positive + negative)`` in ``[-1, 1]`` (0 when it has none), so every
policy can be scored exactly. Preferred = more positive. SFT data mixes positive and negative answers 50/50, so
the SFT policy scores near 0; PPO against a reward model trained on the preferences should move it up.

The phrase lists are disjoint and no phrase contains another, so counting substrings is exact.
"""

from __future__ import annotations

import random

TOPICS = [
    "咖啡", "天气", "这部电影", "地铁", "公园", "早餐", "音乐会", "新手机", "这本书", "火锅",
    "图书馆", "这家酒店", "高铁", "动物园", "博物馆", "这首歌", "奶茶", "夜市", "健身房", "海边",
    "这款游戏", "面包店", "电动车", "露营", "这门课", "超市", "游乐园", "画展", "网球", "这道菜",
    "春天", "小区", "医院", "机场", "书店", "花园", "烤鸭", "滑雪", "旅行", "新电脑",
]
HELDOUT_TOPICS = TOPICS[-8:]  # never seen in training data: eval prompts and held-out pairs
TRAIN_TOPICS = TOPICS[:-8]

QUESTIONS = [
    "你觉得{t}怎么样？", "{t}好不好？", "请评价一下{t}。", "说说你对{t}的看法。", "{t}给你什么感觉？", "你喜欢{t}吗？",
]
POSITIVE = ["非常好", "很棒", "真不错", "令人满意", "特别舒服", "让人开心", "很精彩", "超出预期"]
NEGATIVE = ["很糟糕", "太差了", "令人失望", "特别难受", "让人生气", "很无聊", "浪费时间", "一塌糊涂"]
POSITIVE_CLOSERS = ["我很喜欢。", "下次还想再来。", "推荐给大家。"]
NEGATIVE_CLOSERS = ["我很讨厌。", "再也不想碰了。", "劝大家别试。"]
NEUTRAL = ["{t}还行，一般般。", "{t}说不上来，看情况。"]

POSITIVE_PHRASES = POSITIVE + [c.rstrip("。") for c in POSITIVE_CLOSERS]
NEGATIVE_PHRASES = NEGATIVE + [c.rstrip("。") for c in NEGATIVE_CLOSERS]


def score_text(text: str) -> float:
    """Ground-truth sentiment of ``text`` in ``[-1, 1]``: (pos - neg) / (pos + neg) phrase counts, 0 if none."""
    pos = sum(text.count(p) for p in POSITIVE_PHRASES)
    neg = sum(text.count(p) for p in NEGATIVE_PHRASES)
    return 0.0 if pos + neg == 0 else (pos - neg) / (pos + neg)


def answer(topic: str, sentiment: int, rng: random.Random) -> str:
    """An answer about ``topic`` with sentiment +1, -1 or 0."""
    if sentiment > 0:
        return f"{topic}{rng.choice(POSITIVE)}，{rng.choice(POSITIVE_CLOSERS)}"
    if sentiment < 0:
        return f"{topic}{rng.choice(NEGATIVE)}，{rng.choice(NEGATIVE_CLOSERS)}"
    return rng.choice(NEUTRAL).format(t=topic)


def question(topic: str, rng: random.Random) -> str:
    return rng.choice(QUESTIONS).format(t=topic)


def sft_rows(n: int, seed: int, topics=TRAIN_TOPICS) -> list[dict]:
    """Alpaca rows (instruction / input / output), half positive and half negative answers."""
    rng = random.Random(seed)
    return [
        {"instruction": question(t, rng), "input": "", "output": answer(t, 1 if i % 2 == 0 else -1, rng)}
        for i, t in enumerate(rng.choice(topics) for _ in range(n))
    ]


def ranked_rows(n: int, seed: int, topics=TRAIN_TOPICS) -> list[dict]:
    """Ranked answer lists, best first: [positive, neutral, negative] (3 ordered pairs each)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        t = rng.choice(topics)
        rows.append({"instruction": question(t, rng), "input": "", "output": [answer(t, s, rng) for s in (1, 0, -1)]})
    return rows


def prompt_rows(topics, seed: int, per_topic: int | None = None) -> list[dict]:
    """Prompt rows (instruction only): every question template for every topic, or ``per_topic`` of them."""
    rng = random.Random(seed)
    rows = []
    for t in topics:
        qs = QUESTIONS if per_topic is None else rng.sample(QUESTIONS, per_topic)
        rows.extend({"instruction": q.format(t=t)} for q in qs)
    return rows


def pair_rows(n: int, seed: int, topics=HELDOUT_TOPICS) -> list[dict]:
    """Prompt / chosen / rejected rows (positive preferred over negative)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        t = rng.choice(topics)
        rows.append({"prompt": question(t, rng), "chosen": answer(t, 1, rng), "rejected": answer(t, -1, rng)})
    return rows


def corpus() -> list[str]:
    """All text of the task, for training the demo tokenizer."""
    from .data import DEFAULT_PROMPT_TEMPLATE

    lines = []
    for t in TOPICS:
        lines += [DEFAULT_PROMPT_TEMPLATE.format(question=q.format(t=t)) for q in QUESTIONS]
        lines += [f"{t}{p}，{c}" for p in POSITIVE for c in POSITIVE_CLOSERS]
        lines += [f"{t}{p}，{c}" for p in NEGATIVE for c in NEGATIVE_CLOSERS]
        lines += [n.format(t=t) for n in NEUTRAL]
    return lines
