"""Property tests of the formatter: any text, any column mapping, round-trips without loss; the boundary between
prompt and response is where the template puts it."""

import string

from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from rlhf_trl.data import DataArguments, Template, encode_prompt, encode_response, pair_records, sft_records

# Any non-blank text, Chinese and control characters included (but not the template's own placeholders).
text = st.one_of(
    st.text(min_size=1, max_size=40),
    st.lists(st.sampled_from(["问：", "答：", "\n\n", "<|endoftext|>", "<|pad|>", "{question}", "好", " "]),
             min_size=1, max_size=8).map("".join),
).filter(lambda s: s.strip())
key = st.text(alphabet=string.ascii_lowercase + "_", min_size=1, max_size=12)
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@SETTINGS
@given(question=text, answer=text)
def test_template_round_trip(question, answer):
    t = Template()
    prompt = t.format_prompt(question)
    assert prompt == "问：" + question + "\n\n答："
    assert prompt[len("问："):-len("\n\n答：")] == question
    assert t.format_completion(answer) == answer


@SETTINGS
@given(q=text, good=text, bad=text, qk=key, gk=key, bk=key)
@example(q="0", good="0", bad="R", qk="_", gk="__", bk="history")  # a mapped column is never read as earlier turns
@example(q="q", good="a", bad="b", qk="_", gk="input", bk="__")  # ... nor appended to the question as `input`
def test_any_column_mapping_round_trips(q, good, bad, qk, gk, bk):
    assume(len({qk, gk, bk}) == 3 and good != bad)  # three distinct columns; a pair of two different answers
    row = {qk: q, gk: good, bk: bad}
    args = DataArguments(question_key=qk, good_key=gk, bad_key=bk, dataset_format="pairwise")
    assert pair_records([row], args, "f") == [{"question": q, "history": [], "chosen": good, "rejected": bad}]
    sft = sft_records([{qk: q, gk: good}], DataArguments(question_key=qk, answer_key=gk, dataset_format="alpaca"), "f")
    assert sft[0]["question"] == q and sft[0]["answer"] == good


@SETTINGS
@given(question=text, answer=text)
def test_token_boundary_is_the_template_boundary(tokenizer, question, answer):
    """Decoding the prompt ids gives exactly the rendered prompt, the response ids the answer, then one EOS."""
    t = Template()
    p = encode_prompt(tokenizer, t, question)
    r = encode_response(tokenizer, t, answer)
    assert tokenizer.decode(p) == t.format_prompt(question)
    assert r[-1] == tokenizer.eos_token_id
    assert tokenizer.decode(r[:-1]) == answer
    assert tokenizer.decode(p + r, skip_special_tokens=True) == t.format_prompt(question) + answer
    # special-token text inside the data never becomes a special id: the only EOS is the appended one
    assert tokenizer.eos_token_id not in p + r[:-1] and tokenizer.pad_token_id not in p + r
