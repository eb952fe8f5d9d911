"""The demo task's ground truth (`rlhf_trl.demo_task.score_response`) and its generated data: exact values."""

import itertools
import random

import pytest

from rlhf_trl import demo_task as dt

Q = "你觉得医院怎么样？"


@pytest.mark.parametrize("response, expected", [
    ("医院很棒，我很喜欢。", 1.0),                      # on-topic praise
    ("医院太差了，劝大家别试。", -1.0),                  # on-topic criticism
    ("医院还行，一般般。", 0.0),                        # on-topic, no sentiment phrase
    ("医院很棒，劝大家别试。", 0.0),                     # mixed: 1 positive, 1 negative
    ("医院很棒，令人失望，我很喜欢。", 1 / 3),            # 2 positive, 1 negative
    ("博物馆特别舒服，下次还想再来。", -1.0),             # praise of another topic
    ("医院很棒，博物馆也很棒。", -1.0),                  # names a second topic
    ("很棒，我很喜欢。", -1.0),                          # names no topic
    ("", -1.0),                                        # empty
])
def test_score_response_exact_values(response, expected):
    assert dt.score_response(Q, response) == pytest.approx(expected, abs=0)
    assert dt.on_topic(Q, response) == (response.startswith("医院") and "博物馆" not in response)


def test_off_topic_praise_scores_below_on_topic_neutral_and_as_low_as_criticism():
    praise_elsewhere = dt.score_response(Q, "博物馆特别舒服，下次还想再来。")
    assert praise_elsewhere == dt.OFF_TOPIC_SCORE == -1.0
    assert praise_elsewhere < dt.score_response(Q, "医院还行，一般般。") < dt.score_response(Q, "医院很棒，我很喜欢。")
    assert praise_elsewhere == dt.score_response(Q, "医院很糟糕，我很讨厌。")


def test_topic_of_any_question_template_and_rendered_prompt():
    rng = random.Random(0)
    for t in dt.TOPICS:
        for q in dt.QUESTIONS:
            assert dt.topic_of(q.format(t=t)) == t
        assert dt.topic_of(f"问：{dt.question(t, rng)}\n\n答：") == t
    with pytest.raises(ValueError, match="names exactly one topic"):
        dt.topic_of("你好")
    with pytest.raises(ValueError, match="names exactly one topic"):
        dt.topic_of("咖啡和奶茶哪个好？")


def test_substring_counting_is_exact():
    """No topic contains another or occurs in the fixed text; no phrase contains another; the phrase lists are disjoint."""
    for a, b in itertools.permutations(dt.TOPICS, 2):
        assert a not in b
    fixed = dt.QUESTIONS + dt.POSITIVE_PHRASES + dt.NEGATIVE_PHRASES + dt.POSITIVE_CLOSERS + dt.NEGATIVE_CLOSERS
    fixed += [n.format(t="") for n in dt.NEUTRAL]
    for t, text in itertools.product(dt.TOPICS, fixed):
        assert t not in text.replace("{t}", "")
    phrases = dt.POSITIVE_PHRASES + dt.NEGATIVE_PHRASES
    assert len(set(phrases)) == len(phrases)
    for a, b in itertools.permutations(phrases, 2):
        assert a not in b


def test_generated_answers_score_as_labelled():
    rng = random.Random(1)
    for t in dt.TOPICS:
        q = dt.question(t, rng)
        assert dt.score_response(q, dt.answer(t, 1, rng)) == 1.0
        assert dt.score_response(q, dt.answer(t, -1, rng)) == -1.0
        assert dt.score_response(q, dt.answer(t, 0, rng)) == 0.0
        assert dt.score_response(q, dt.answer(dt.other_topic(t, rng), 1, rng)) == -1.0


def test_sft_rows_are_on_topic_and_half_positive():
    rows = dt.sft_rows(200, seed=1, topics=dt.TOPICS)
    scores = [dt.score_response(r["instruction"], r["output"]) for r in rows]
    assert scores == [1.0 if i % 2 == 0 else -1.0 for i in range(200)]
    assert rows == dt.sft_rows(200, seed=1, topics=dt.TOPICS)  # seeded


def test_ranked_rows_follow_the_ground_truth_and_teach_the_topic():
    rows = dt.ranked_rows(100, seed=2)
    assert rows == dt.ranked_rows(100, seed=2)
    for i, r in enumerate(rows):
        assert dt.topic_of(r["instruction"]) in dt.TRAIN_TOPICS
        scores = [dt.score_response(r["instruction"], a) for a in r["output"]]
        assert scores == [1.0, 0.0, -1.0]
        last = r["output"][2]
        if i % 2:  # praise of another training topic
            assert dt.sentiment(last) == 1.0 and dt.topics_in(last)[0] in dt.TRAIN_TOPICS
        else:
            assert dt.on_topic(r["instruction"], last) and dt.sentiment(last) == -1.0


def test_heldout_pairs_are_on_heldout_topics_with_both_kinds_of_rejected():
    rows = dt.pair_rows(50, seed=5)
    assert rows == dt.pair_rows(50, seed=5)
    for i, r in enumerate(rows):
        assert dt.topic_of(r["prompt"]) in dt.HELDOUT_TOPICS
        assert dt.score_response(r["prompt"], r["chosen"]) == 1.0
        assert dt.score_response(r["prompt"], r["rejected"]) == -1.0
        assert dt.on_topic(r["prompt"], r["rejected"]) == (i % 2 == 0)
