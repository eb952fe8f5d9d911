"""Files as projects ship them: MOSS-RLHF's JSON arrays of dialogue lists (1, 3, 5, 7 or 2 strings:
user, assistant, user, ...) read as prompts and SFT records with their history, bad lists one line each and
skippable; ``dataset_encoding`` for every text loader (JSON arrays, JSON lines, CSV, compressed), a UTF-8 file read
in place and a file in another codec from a cached UTF-8 copy."""

import bz2
import gzip
import json
import lzma
import os

import pytest

from rlhf_trl.data import DataArguments, DataError, DataReport, read_records
from rlhf_trl.data.read import UTF8_CACHE
from rlhf_trl.data.records import SKIP_HINT

# the shape of MOSS-RLHF's data/ppo_data/train.json: [prompt, answer] pairs, then dialogues ending with a user turn
MOSS = [
    ["列出两种沙漠生物群系的名称。", "1. 撒哈拉沙漠\n2. 地中海沙漠和灌木丛"],
    ["天气预警的报告"],
    ["天气预警的报告", "目前没有收到天气预警的通知，请问您想查看哪个地区的天气情况？", "请帮我查询明天北京的天气。"],
    ["天气预警的报告", "目前没有收到天气预警的通知。", "请帮我查询明天北京的天气。", "北京明天多云转晴，最高气温28℃。",
     "能否帮我生成一个关于野外求生的故事？"],
    ["生成一个诗歌！", "月上柳梢头，人约黄昏后。", "给我列举一些世界著名的艺术品。", "《蒙娜丽莎》、《最后的晚餐》。",
     "为什么数学是重要的学科？", "数学在科学、工程、经济学中都有应用。", "请给我一些关于健康生活的建议。"],
]


def write_moss(path, rows=MOSS, opener=open):
    with opener(path, "wt", encoding="utf-8") as f:  # indented like MOSS-RLHF's file
        json.dump(rows, f, ensure_ascii=False, indent=3)
    return str(path)


@pytest.fixture(autouse=True)
def datasets_cache(tmp_path, monkeypatch):
    """The datasets cache (and the UTF-8 copies in it) in this test's folder."""
    import datasets.config

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-datasets")
    return tmp_path / "hf-datasets"


# --- dialogue lists ----------------------------------------------------------------------------------------------
def test_moss_prompt_file_reads_as_prompts_with_history_and_answers_dropped(tmp_path):
    path = write_moss(tmp_path / "train.json")
    report = DataReport("ppo")
    prompts = read_records(DataArguments(dataset_name=path), "prompts", report)
    assert prompts == [
        {"question": MOSS[0][0], "history": []},  # [prompt, answer]: the answer dropped
        {"question": "天气预警的报告", "history": []},
        {"question": MOSS[2][2], "history": [(MOSS[2][0], MOSS[2][1])]},
        {"question": MOSS[3][4], "history": [(MOSS[3][0], MOSS[3][1]), (MOSS[3][2], MOSS[3][3])]},
        {"question": MOSS[4][6], "history": [(MOSS[4][0], MOSS[4][1]), (MOSS[4][2], MOSS[4][3]),
                                             (MOSS[4][4], MOSS[4][5])]}]
    report.write(str(tmp_path / "out"))
    entry = json.loads((tmp_path / "out" / "data_report.json").read_text(encoding="utf-8"))["sources"][0]
    assert entry["rows_read"] == 5 and entry["records"] == 5 and entry["skipped"] == {}
    assert entry["dialogue_lists"] == {"rows": 5, "by_length": {"1": 1, "2": 1, "3": 1, "5": 1, "7": 1},
                                       "answers_dropped": 1}


def test_moss_file_reads_as_sft_targets_with_history(tmp_path):
    path = write_moss(tmp_path / "train.json")
    report = DataReport("sft")
    sft = read_records(DataArguments(dataset_name=path), "sft", report)
    assert [(r["question"], r["history"], r["answer"]) for r in sft] == [
        (MOSS[0][0], [], MOSS[0][1]),  # an even list: its last item is the target
        (MOSS[2][0], [], MOSS[2][1]),  # odd lists: the last answer is the target, the user turn after it dropped
        (MOSS[3][2], [(MOSS[3][0], MOSS[3][1])], MOSS[3][3]),
        (MOSS[4][4], [(MOSS[4][0], MOSS[4][1]), (MOSS[4][2], MOSS[4][3])], MOSS[4][5])]
    assert {r: (e["count"], e["bad"]) for r, e in report.skipped.items()} == {
        "a dialogue list of one user turn (no answer to learn)": (1, False)}  # a valid prompt row: not bad
    assert report.sources[0]["dialogue_lists"] == {"rows": 5, "by_length": {"1": 1, "2": 1, "3": 1, "5": 1, "7": 1},
                                                   "last_user_turns_dropped": 3}
    # the same rows through a compressed file, with max_samples: counted over the rows read
    report = DataReport("ppo")
    gz = write_moss(tmp_path / "train.json.gz", opener=gzip.open)
    assert len(read_records(DataArguments(dataset_name=gz, max_samples=3), "prompts", report)) == 3
    assert report.sources[0]["dialogue_lists"] == {"rows": 3, "by_length": {"1": 1, "2": 1, "3": 1},
                                                   "answers_dropped": 1}


BAD_LISTS = [  # (row, the error after "row 1")
    (["你好", 3], ", field '[1]': must be a string (a dialogue list alternates user / assistant turns), got a JSON "
                  "number"),
    (["你好", ["嵌套"]], ", field '[1]': must be a string (a dialogue list alternates user / assistant turns), got a "
                       "JSON array"),
    (["你好", "好", None], ", field '[2]': must be a string (a dialogue list alternates user / assistant turns), got "
                         "a JSON null"),
    ([" ", "好"], ", field '[0]': is an empty user turn"),
    ([], ": must be a non-empty list of strings (user, assistant, user, ... turns), got an empty list"),
    ({"instruction": "你好"}, ": must be a non-empty list of strings (user, assistant, user, ... turns), got a JSON "
                            "object"),
    ("你好", ": must be a non-empty list of strings (user, assistant, user, ... turns), got a JSON string"),
]


@pytest.mark.parametrize("bad,message", BAD_LISTS)
@pytest.mark.parametrize("kind", ["prompts", "sft"])
def test_a_bad_dialogue_list_is_one_line_naming_file_row_and_field(tmp_path, bad, message, kind):
    path = write_moss(tmp_path / "train.json", [MOSS[0], bad, MOSS[2]])
    with pytest.raises(DataError) as err:
        read_records(DataArguments(dataset_name=path), kind)
    assert str(err.value) == f"{path}, row 1{message}{SKIP_HINT}"


def test_bad_dialogue_lists_are_skipped_and_counted(tmp_path):
    rows = [MOSS[k % 5] for k in range(40)]
    for k, (bad, _) in zip((5, 11, 17, 23, 29, 35, 39), BAD_LISTS):
        rows[k] = bad
    path = write_moss(tmp_path / "train.json", rows)
    report = DataReport("ppo")
    args = DataArguments(dataset_name=path, on_bad_row="skip", max_bad_row_fraction=0.2)
    assert len(read_records(args, "prompts", report)) == 33
    assert sum(e["count"] for e in report.skipped.values()) == 7 and all(e["bad"] for e in report.skipped.values())
    assert report.skipped["field '[N]': is an empty user turn"]["examples"] == [f"{path}, row 23"]
    assert report.sources[0]["bad_rows"] == 7 and report.sources[0]["dialogue_lists"]["rows"] == 38
    with pytest.raises(DataError, match=r"7 of 40 rows are bad, more than max_bad_row_fraction=0\.05"):
        read_records(DataArguments(dataset_name=path, on_bad_row="skip"), "prompts")


def test_a_json_array_of_lists_that_is_not_json_names_the_file(tmp_path):
    path = tmp_path / "train.json"
    path.write_text('[["你好", "好"], ["天气"', encoding="utf-8")
    with pytest.raises(DataError) as err:
        read_records(DataArguments(dataset_name=str(path)), "prompts")
    assert str(err.value).startswith(f"{path}: cannot be read as json: not valid JSON: ")


# --- encodings ---------------------------------------------------------------------------------------------------
ROWS = [{"instruction": "你好，世界", "output": "天氣晴朗"}, {"instruction": "1+1?", "output": "二"}]
OPENERS = {"": open, ".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}


def text_of(suffix: str) -> str:
    if suffix.startswith(".jsonl"):
        return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in ROWS)
    if suffix.startswith(".csv"):
        return "instruction,output\n" + "".join(f"{r['instruction']},{r['output']}\n" for r in ROWS)
    return json.dumps(ROWS, ensure_ascii=False, indent=2)  # a JSON array of objects


def write_encoded(path, text: str, encoding: str) -> bytes:
    data = text.encode(encoding)
    with OPENERS.get(os.path.splitext(str(path))[1], open)(path, "wb") as f:
        f.write(data)
    return data


@pytest.mark.parametrize("suffix", [".json", ".jsonl", ".csv", ".jsonl.gz", ".json.gz", ".csv.bz2", ".json.xz"])
@pytest.mark.parametrize("encoding", ["gbk", "big5", "utf-16"])
def test_every_text_loader_reads_dataset_encoding_and_fails_without_it(tmp_path, suffix, encoding, datasets_cache):
    path = tmp_path / f"data{suffix}"
    data = write_encoded(path, text_of(suffix), encoding)
    with pytest.raises(UnicodeDecodeError) as bad:
        data.decode("utf-8")
    line = data[: bad.value.start].count(b"\n") + 1
    with pytest.raises(DataError) as err:
        read_records(DataArguments(dataset_name=str(path)), "sft")
    assert str(err.value) == (f"{path}: line {line}, byte {bad.value.start}: not valid utf-8 ({bad.value.reason}); "
                              "set dataset_encoding to the file's encoding (gbk, gb18030, big5, ...)")
    got = read_records(DataArguments(dataset_name=str(path), dataset_encoding=encoding), "sft")
    assert [(r["question"], r["answer"]) for r in got] == [(r["instruction"], r["output"]) for r in ROWS]
    copies = os.listdir(datasets_cache / UTF8_CACHE)  # one decompressed UTF-8 copy
    assert len(copies) == 1 and copies[0].endswith("." + suffix.split(".")[1])


def test_a_moss_file_in_gbk_reads_with_dataset_encoding(tmp_path):
    path = tmp_path / "train.json.gz"
    write_encoded(path, json.dumps(MOSS, ensure_ascii=False, indent=3), "gbk")
    with pytest.raises(DataError, match=r"train\.json\.gz: line 3, byte \d+: not valid utf-8"):
        read_records(DataArguments(dataset_name=str(path)), "prompts")
    prompts = read_records(DataArguments(dataset_name=str(path), dataset_encoding="gbk"), "prompts")
    assert [p["question"] for p in prompts] == [MOSS[0][0], MOSS[1][0], MOSS[2][2], MOSS[3][4], MOSS[4][6]]


def test_utf8_is_read_in_place_and_a_copy_is_made_once_per_file_version(tmp_path, datasets_cache):
    path = tmp_path / "data.jsonl"
    write_encoded(path, text_of(".jsonl"), "utf-8")
    assert len(read_records(DataArguments(dataset_name=str(path), dataset_encoding="UTF8"), "sft")) == 2
    assert not (datasets_cache / UTF8_CACHE).exists()  # UTF-8: no copy
    write_encoded(path, text_of(".jsonl"), "gbk")
    args = DataArguments(dataset_name=str(path), dataset_encoding="gbk")
    assert len(read_records(args, "sft")) == 2
    (copy,) = os.listdir(datasets_cache / UTF8_CACHE)
    stamp = os.stat(datasets_cache / UTF8_CACHE / copy).st_mtime_ns
    assert len(read_records(args, "sft")) == 2  # the same file: the same copy, not remade
    assert os.listdir(datasets_cache / UTF8_CACHE) == [copy]
    assert os.stat(datasets_cache / UTF8_CACHE / copy).st_mtime_ns == stamp
    write_encoded(path, text_of(".jsonl").replace("二", "两"), "gbk")  # the file changed: a new copy, new rows
    os.utime(path, ns=(stamp + 10**9, stamp + 10**9))
    assert read_records(args, "sft")[1]["answer"] == "两"
    assert len(os.listdir(datasets_cache / UTF8_CACHE)) == 2


def test_a_byte_not_valid_in_dataset_encoding_is_named_across_read_chunks(tmp_path):
    """An invalid byte after a character cut at the 1 MiB chunk boundary: its offset counts the cut bytes once."""
    data = ('{"instruction": "' + "你" * (1 << 19) + "\n").encode("gbk")  # 17 bytes, then 2-byte characters:
    data += b"\xff\xff" + b'"}\n'  # the 1 MiB boundary cuts the last one in two
    path = tmp_path / "big.jsonl"
    path.write_bytes(data)
    with pytest.raises(UnicodeDecodeError) as bad:
        data.decode("gbk")
    with pytest.raises(DataError) as err:
        read_records(DataArguments(dataset_name=str(path), dataset_encoding="gbk"), "sft")
    assert str(err.value).startswith(f"{path}: line 2, byte {bad.value.start}: not valid gbk (")


def test_a_damaged_compressed_file_is_one_line(tmp_path):
    path = tmp_path / "data.jsonl.gz"
    path.write_bytes(gzip.compress(text_of(".jsonl").encode("gbk"))[:-12] + b"garbage")
    with pytest.raises(DataError) as err:
        read_records(DataArguments(dataset_name=str(path), dataset_encoding="gbk"), "sft")
    assert str(err.value).startswith(f"{path}: cannot be decompressed")
