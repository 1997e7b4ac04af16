"""The data pipeline of lean-train: files -> records -> token documents -> packed batches.

    records = load_records("data/")                       # a file, or a folder read recursively
    docs = tokenize_records(records, tok, max_len=2048)    # [(ids, mask)], numpy int32 / bool
    train, heldout = split_heldout(docs, 0.05, seed=0)
    for docs_b in pack_batches(train, max_tokens=8192, seed=epoch): batch = lean.pack(docs_b, 8192)

Files (a folder is read recursively in sorted path order; hidden files and folders are skipped):
  .jsonl        one JSON record per line (blank lines skipped); source tag "file:line"
  .json         a list of records, or {"data": [records]}; source tag "file[index]"
  .yml / .yaml  the same as .json, or a chatterbot corpus file {"conversations": [[q, a, ...]]}
  .txt          the whole file is one plain text; source tag "file:1"
Record shapes, detected per record (first match wins):
  chat          {"messages": [{"role": ..., "content": ...}, ...]}, at least one assistant turn;
                other message keys (tool_calls, name, reasoning_content ...) reach the template
  instruction   {"instruction": ..., "input": ... (optional), "output": ...}
  text          {"text": ...}
  sharegpt      {"conversations": [{"from": "human" | "gpt" | "system" | "tool", "value": ...}, ...]}:
                a chat (human -> user, gpt -> assistant)
  chatterbot    {"conversations": [[q, a, q, ...], ...]}: one chat per inner list, turns
                alternating user / assistant; source tag "file:conversations[index]"; entries that
                are not lists of 2+ strings are skipped with a DataWarning naming them

Loss masks (mask[t] = 1: token t is a target, predicted from token t-1; see batch.py):
  text          every token; tokenizer.json's post-processor adds its special tokens (BOS for
                Llama 3, nothing for SmolLM2) and EOS is appended; cut into windows of max_len
  chat          assistant turns only. The assistant character spans come from rendering prefixes:
                render(messages[:i], add_generation_prompt=True) is a prefix of
                render(messages[:i+1]) for an assistant message i, and the span lies between their
                lengths, so the end-of-turn token (<|im_end|>, <|eot_id|>) is a target and the
                model learns to stop. A token is a target when its character offsets overlap a span.
  instruction   a two-turn chat (user = instruction + "\\n\\n" + input, assistant = output) when the
                tokenizer has a chat template; otherwise "instruction\\n\\ninput\\n\\noutput" + EOS
                with the loss on the output and EOS
Chats longer than max_len are truncated (counted in `stats`); documents left with no target are
dropped (counted). A dataset with no target left raises.

Errors are DataError naming the file (and line or index) and the fix.
Caution: a chat template that rewrites earlier turns (one that strips reasoning from past assistant
turns, say) breaks the prefix rule; such a chat raises rather than getting a wrong mask.
Tested: tests/test_data.py (every format and error, the chatterbot corpus, the SmolLM2 mask token
by token, packing budget, determinism and optimality).
"""
import bisect
import importlib.util
import json
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np

SUFFIXES = (".jsonl", ".json", ".yml", ".yaml", ".txt")
SHAPES = ('{"messages": [{"role", "content"}, ...]}, {"instruction", "input"?, "output"}, '
          '{"text"}, ShareGPT\'s {"conversations": [{"from", "value"}, ...]} or chatterbot\'s '
          '{"conversations": [[question, answer, ...], ...]}')


class DataError(ValueError):
    pass


class DataWarning(UserWarning):
    pass


@dataclass(frozen=True)
class Record:
    """One training example. kind: "text" (text), "instruction" (instruction, input, output) or
    "chat" (messages: a tuple of {"role", "content", ...} dicts). source: where it came from."""
    kind: str
    source: str
    text: str = ""
    messages: tuple = ()
    instruction: str = ""
    input: str = ""
    output: str = ""


# ---------------------------------------------------------------- files -> records

def load_records(path) -> list:
    """Records of a data file, or of every data file under a folder (recursive, sorted)."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"data path {path} does not exist: pass a data file or a folder of them")
    files = [path] if path.is_file() else _data_files(path)
    if not files:
        raise DataError(f"{path} holds no data file: add {', '.join(SUFFIXES)} files")
    records = []
    for f in files:
        records.extend(_read_file(f))
    if not records:
        raise DataError(f"{path}: no records in {len(files)} file(s) (empty, or blank lines only): "
                        "add examples, or point --data at the files that hold them")
    return records


def _data_files(folder: Path) -> list:
    files = []
    for p in sorted(folder.rglob("*")):
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(folder).parts):
            files.append(p)
    return files


def _read_file(f: Path) -> list:
    suffix = f.suffix.lower()
    if suffix == ".jsonl":
        return _read_jsonl(f)
    if suffix == ".txt":
        text = _text(f)
        if not text.strip():
            raise DataError(f"{f}: the text file is empty: remove it or give it text")
        return [Record("text", f"{f}:1", text=text)]
    if suffix == ".json":
        return _read_document(f, _load_json(f))
    if suffix in (".yml", ".yaml"):
        return _read_document(f, _load_yaml(f))
    raise DataError(f"{f}: unknown data file extension {f.suffix!r}: supported are "
                    f"{', '.join(SUFFIXES)}; rename the file or move it out of the data folder")


def _text(f: Path, data: bytes = None, first_line: int = 1) -> str:
    """f's bytes (or data, f's line first_line on) as UTF-8; DataError naming the line if they are not."""
    data = f.read_bytes() if data is None else data
    try:
        text = data.decode("utf-8")
        return text[1:] if first_line == 1 and text.startswith("\ufeff") else text  # a BOM is no text
    except UnicodeDecodeError as e:
        line = first_line + data.count(b"\n", 0, e.start)
        raise DataError(f"{f}:{line}: not UTF-8 text (byte 0x{data[e.start]:02x}): save the file as UTF-8") from None


def _read_jsonl(f: Path) -> list:
    records = []
    with open(f, "rb") as fh:
        for lineno, raw in enumerate(fh, 1):
            line = _text(f, raw, lineno)
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{f}:{lineno}: malformed JSON ({e.msg} at column {e.colno}): "
                                "write one complete JSON object per line") from e
            records.extend(_parse_record(obj, f"{f}:{lineno}"))
    return records


def _load_json(f: Path):
    try:
        return json.loads(_text(f))
    except json.JSONDecodeError as e:
        raise DataError(f"{f}:{e.lineno}: malformed JSON ({e.msg} at column {e.colno}): fix the "
                        "file (a JSON list of records, or use .jsonl for one record per line)") from e


def _load_yaml(f: Path):
    import yaml
    try:
        return yaml.safe_load(_text(f))
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = f":{mark.line + 1}" if mark is not None else ""
        raise DataError(f"{f}{line}: malformed YAML ({getattr(e, 'problem', e)}): fix the file") from e


def _read_document(f: Path, obj) -> list:
    """A parsed .json/.yaml file: a list of records, {"data": [...]}, or one chatterbot record."""
    if isinstance(obj, dict) and "conversations" in obj:
        return _parse_record(obj, str(f))
    if isinstance(obj, dict) and isinstance(obj.get("data"), list):
        obj = obj["data"]
    if not isinstance(obj, list):
        found = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
        raise DataError(f"{f}: expected a list of records or {{\"data\": [records]}}, found {found}: "
                        "wrap the records in a list (or use .jsonl, one record per line)")
    records = []
    for i, item in enumerate(obj):
        records.extend(_parse_record(item, f"{f}[{i}]"))
    return records


def _parse_record(obj, source: str) -> list:
    """One raw record -> a list of Records (a chatterbot record yields one per conversation)."""
    if not isinstance(obj, dict):
        raise DataError(f"{source}: a record must be an object, found {type(obj).__name__}: "
                        f"write one of {SHAPES}")
    if "messages" in obj:
        return [Record("chat", source, messages=_check_messages(obj["messages"], source))]
    if "instruction" in obj:
        return [_instruction(obj, source)]
    if "text" in obj:
        return [Record("text", source, text=_string(obj["text"], "text", source))]
    if "conversations" in obj:
        conv = obj["conversations"]
        if isinstance(conv, list) and conv and all(isinstance(t, dict) for t in conv):
            return [Record("chat", source, messages=_check_messages(_sharegpt(conv, source), source))]
        return _chatterbot(conv, source)
    raise DataError(f"{source}: unknown record format (keys found: {sorted(map(str, obj))}): "
                    f"write one of {SHAPES}")


def _string(value, name: str, source: str) -> str:
    if not isinstance(value, str):
        raise DataError(f"{source}: {name!r} must be a string, found {type(value).__name__}: "
                        "quote it in the data file")
    return value


def _instruction(obj, source: str) -> Record:
    if "output" not in obj:
        raise DataError(f"{source}: an instruction record needs 'output' (keys found: "
                        f"{sorted(map(str, obj))}): add the answer under 'output'")
    inp = obj.get("input") or ""
    return Record("instruction", source, instruction=_string(obj["instruction"], "instruction", source),
                  input=_string(inp, "input", source), output=_string(obj["output"], "output", source))


SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "chatgpt": "assistant", "model": "assistant", "system": "system", "tool": "tool"}


def _sharegpt(turns, source: str) -> list:
    """ShareGPT's {"conversations": [{"from", "value"}, ...]} as chat messages (human -> user,
    gpt -> assistant, system, tool)."""
    out = []
    for j, t in enumerate(turns):
        if "from" not in t or "value" not in t:
            raise DataError(f"{source}: conversations[{j}] needs 'from' and 'value' (found {sorted(map(str, t))}): "
                            'ShareGPT turns are {"from": "human" | "gpt" | "system", "value": "..."}')
        role = SHAREGPT_ROLES.get(t["from"]) if isinstance(t["from"], str) else None
        if role is None:
            raise DataError(f"{source}: conversations[{j}].from = {t['from']!r}: use one of "
                            f"{', '.join(SHAREGPT_ROLES)}")
        out.append({"role": role, "content": t["value"]})
    return out


def _check_messages(messages, source: str) -> tuple:
    """Messages as the chat template gets them: role and content checked, other keys (tool_calls,
    name, reasoning_content, tool_call_id ...) passed through as transformers passes them."""
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{source}: 'messages' must be a non-empty list of {{\"role\", \"content\"}}")
    out = []
    for j, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            keys = sorted(map(str, m)) if isinstance(m, dict) else type(m).__name__
            raise DataError(f"{source}: message {j} needs 'role' and 'content' (found {keys}): "
                            'write {"role": "user" | "assistant" | "system", "content": "..."}')
        role, content = _string(m["role"], f"messages[{j}].role", source), m["content"]
        if role in ("human", "gpt"):
            raise DataError(f"{source}: messages[{j}].role = {role!r} is ShareGPT's name: write "
                            f"{SHAREGPT_ROLES[role]!r}, or use the ShareGPT shape {{\"conversations\": [{{\"from\", \"value\"}}]}}")
        if isinstance(content, list):
            raise DataError(f"{source}: messages[{j}].content is a list of parts: lean trains text models; "
                            "join the text parts into one string")
        if not (content is None and m.get("tool_calls")):  # OpenAI's tool-call turns carry null content
            _string(content, f"messages[{j}].content", source)
        out.append(dict(m))
    if not any(m["role"] == "assistant" for m in out):
        raise DataError(f"{source}: the chat has no assistant turn, so nothing to learn: add an "
                        "assistant message or drop the record")
    return tuple(out)


def _chatterbot(conversations, source: str) -> list:
    """One chat per [q, a, ...] list; malformed entries are skipped with one warning per file
    (the corpus itself holds one: trivia.yml's conversation 13 is a bare string)."""
    if not isinstance(conversations, list):
        raise DataError(f"{source}: 'conversations' must be a list of [question, answer, ...] lists")
    records, skipped = [], []
    for i, conv in enumerate(conversations):
        if isinstance(conv, list) and conv and isinstance(conv[0], dict):
            raise DataError(f"{source}:conversations[{i}]: turns are objects in a list of lists: ShareGPT "
                            'records are {"conversations": [{"from", "value"}, ...]}, one list per record')
        if not (isinstance(conv, list) and len(conv) >= 2 and all(isinstance(t, str) for t in conv)):
            skipped.append(i)
            continue
        roles = ("user", "assistant")
        messages = tuple({"role": roles[j % 2], "content": t} for j, t in enumerate(conv))
        records.append(Record("chat", f"{source}:conversations[{i}]", messages=messages))
    if skipped:
        warnings.warn(f"{source}: skipped {len(skipped)} malformed conversations (indices "
                      f"{skipped[:10]}): each must be a list [question, answer, ...] of strings; "
                      "quote values YAML would read as numbers or booleans", DataWarning, stacklevel=2)
    return records


def default_dataset() -> Path:
    """The english folder of chatterbot-corpus: 21 YAML files, about 2,000 question/answer chats."""
    spec = importlib.util.find_spec("chatterbot_corpus")
    if spec is None or not spec.submodule_search_locations:
        raise DataError("no dataset given and chatterbot-corpus is not installed: "
                        "pip install --no-deps chatterbot-corpus==1.3.3, or pass a data path")
    folder = Path(spec.submodule_search_locations[0]) / "data" / "english"
    if not folder.is_dir():
        raise DataError(f"{folder} is missing from the chatterbot-corpus install: reinstall it with "
                        "pip install --no-deps --force-reinstall chatterbot-corpus==1.3.3")
    return folder


# ---------------------------------------------------------------- records -> documents

def tokenize_records(records, tok, *, max_len: int, stats: dict = None) -> list:
    """Token documents [(ids int32, mask bool)] of records, each at most max_len tokens.

    stats, if given, is filled with counts: records, docs, tokens, targets, text_windows,
    truncated (chats cut at max_len), dropped (documents left with no target).
    """
    if max_len < 2:
        raise DataError(f"max_len={max_len}: a document needs at least 2 tokens to carry a target")
    if not records:
        raise DataError("no records to tokenize: the data path holds no examples")
    counts = dict(records=len(records), docs=0, tokens=0, targets=0, text_windows=0,
                  truncated=0, dropped=0)
    docs = []
    for rec in records:
        try:
            rec_docs = _record_docs(rec, tok, max_len, counts)
        except DataError:
            raise
        except Exception as e:  # the template's raise_exception, a lone surrogate the tokenizer refuses ...
            raise DataError(f"{rec.source}: the chat template or the tokenizer failed on this record "
                            f"({type(e).__name__}: {e}): fix the record or drop it") from e
        for ids, mask in rec_docs:
            n_targets = int(mask[1:].sum())  # token 0 has no predecessor: never a target
            if n_targets == 0:
                counts["dropped"] += 1
                continue
            docs.append((ids, mask))
            counts["tokens"] += len(ids)
            counts["targets"] += n_targets
    counts["docs"] = len(docs)
    if stats is not None:
        stats.update(counts)
    if not docs:
        raise DataError(_no_target_message(records, max_len, counts))
    return docs


def _no_target_message(records, max_len, counts) -> str:
    files = sorted({r.source.split(":")[0].split("[")[0] for r in records})
    shown = ", ".join(files[:3]) + (f" and {len(files) - 3} more" if len(files) > 3 else "")
    head = (f"{shown}: no token carries a loss after tokenizing {counts['records']} records "
            f"({counts['truncated']} truncated at max_len={max_len}, {counts['dropped']} dropped): ")
    if all(r.kind == "text" for r in records):  # a text's every token after the first is a target
        return head + "every text tokenizes to fewer than 2 tokens (empty?): give the records text"
    return (head + "likely max_len is too small, so every chat is cut before its first assistant reply "
            "(raise max_len), or the chat template renders no assistant text")


def _record_docs(rec: Record, tok, max_len: int, counts: dict) -> list:
    if rec.kind == "text":
        return _text_docs(rec.text, tok, max_len, counts)
    if rec.kind == "instruction" and tok.chat_template is None:
        return [_truncate(*_plain_instruction(rec, tok), max_len, counts)]
    messages = rec.messages
    if rec.kind == "instruction":
        user = rec.instruction + ("\n\n" + rec.input if rec.input else "")
        messages = ({"role": "user", "content": user}, {"role": "assistant", "content": rec.output})
    text, spans = _assistant_spans(tok, messages, rec.source)
    ids, offsets = tok.encode_with_offsets(text, add_special_tokens=False)
    return [_truncate(np.asarray(ids, np.int32), _mask_from_spans(offsets, spans), max_len, counts)]


def _text_docs(text: str, tok, max_len: int, counts: dict) -> list:
    ids = tok.encode(text, add_special_tokens=True)
    if tok.eos_id is not None and (not ids or ids[-1] != tok.eos_id):  # unless the post-processor added it
        ids.append(tok.eos_id)
    ids = np.asarray(ids, np.int32)
    docs = [(w, np.ones(len(w), bool)) for w in np.split(ids, range(max_len, len(ids), max_len))]
    counts["text_windows"] += len(docs)
    return docs


def _plain_instruction(rec: Record, tok):
    """No chat template: "instruction\\n\\ninput\\n\\noutput" + EOS, the loss on output and EOS."""
    prompt = rec.instruction + ("\n\n" + rec.input if rec.input else "") + "\n\n"
    full = prompt + rec.output
    ids, offsets = tok.encode_with_offsets(full, add_special_tokens=True)
    mask = _mask_from_spans(offsets, [(len(prompt), len(full))])
    if tok.eos_id is not None and (not ids or ids[-1] != tok.eos_id):  # unless the post-processor added it
        ids, mask = list(ids) + [tok.eos_id], np.append(mask, True)
    elif tok.eos_id is not None and len(mask):
        mask[-1] = True  # the post-processor's EOS: a target too
    return np.asarray(ids, np.int32), mask


def _truncate(ids, mask, max_len: int, counts: dict):
    if len(ids) > max_len:
        counts["truncated"] += 1
        ids, mask = ids[:max_len], mask[:max_len]
    return ids, mask


def _assistant_spans(tok, messages, source: str):
    """The rendered chat and the character spans [start, end) of its assistant turns."""
    messages = list(messages)
    full = tok.apply_chat_template(messages)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = tok.apply_chat_template(messages[:i], add_generation_prompt=True)
        upto = full if i == len(messages) - 1 else tok.apply_chat_template(messages[:i + 1])
        if not (upto.startswith(before) and full.startswith(upto)):
            raise DataError(
                f"{source}: the chat template does not render assistant turn {i} as an extension of "
                "the turns before it (it rewrites earlier turns, or the chat starts with an "
                "assistant message), so its loss mask cannot be found: start chats with a user or "
                "system turn, or use a template whose prefixes render unchanged")
        spans.append((len(before), len(upto)))
    return full, spans


def _mask_from_spans(offsets, spans) -> np.ndarray:
    """mask[t] = token t's characters overlap a span (a zero-width token counts at its start)."""
    off = np.asarray(offsets, np.int64).reshape(-1, 2)
    start, end = off[:, 0], np.maximum(off[:, 1], off[:, 0] + 1)
    mask = np.zeros(len(off), bool)
    for s, e in spans:
        mask |= (start < e) & (end > s)
    return mask


# ---------------------------------------------------------------- documents -> batches

def _doc_len(doc) -> int:
    return len(doc[0]) if isinstance(doc, tuple) else len(doc)


def pack_batches(docs, max_tokens: int, *, seed: int = 0, shuffle: bool = True) -> list:
    """Best-fit decreasing: documents (each <= max_tokens) into batches of <= max_tokens tokens.

    Longest first (ties broken by a seeded permutation), each into the fullest batch it still fits,
    else a new batch; the batch order is then shuffled with the seed. Deterministic for a seed.
    """
    lengths = [_doc_len(d) for d in docs]
    for i, n in enumerate(lengths):
        if n > max_tokens:
            raise DataError(f"document {i} has {n} tokens, over max_tokens={max_tokens}: tokenize "
                            "with max_len <= max_tokens")
    rng = np.random.default_rng(seed)
    tiebreak = rng.permutation(len(docs))
    order = sorted(range(len(docs)), key=lambda i: (-lengths[i], tiebreak[i]))
    bins, free = [], []  # free: sorted (room left, bin index)
    for i in order:
        k = bisect.bisect_left(free, (lengths[i], -1))
        if k == len(free):
            bins.append([i])
            bisect.insort(free, (max_tokens - lengths[i], len(bins) - 1))
        else:
            room, b = free.pop(k)
            bins[b].append(i)
            bisect.insort(free, (room - lengths[i], b))
    if shuffle:
        bins = [bins[j] for j in rng.permutation(len(bins))]
    return [[docs[i] for i in b] for b in bins]


def split_heldout(docs, fraction: float, seed: int = 0):
    """(train, heldout): a seeded random `fraction` of docs held out, original order kept in both.

    At least one document is held out when fraction > 0 and there are 2 or more documents.
    """
    if not 0.0 <= fraction < 1.0:
        raise DataError(f"held-out fraction {fraction} is outside [0, 1): pass e.g. 0.05")
    n = len(docs)
    k = 0 if fraction == 0 or n < 2 else min(n - 1, max(1, round(fraction * n)))
    held = set(np.random.default_rng(seed).permutation(n)[:k].tolist())  # sync: none (numpy on the host)
    train = [d for i, d in enumerate(docs) if i not in held]
    heldout = [d for i, d in enumerate(docs) if i in held]
    return train, heldout
