"""Data files -> records: the file formats and record shapes lean-train reads (data.py goes on).

    records = load_records("data/")      # a file, or a folder read recursively

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

Errors are DataError naming the file (and line or index) and the fix; a file that is not UTF-8
names its line, a UTF-8 BOM is skipped.
Tested: tests/test_data.py (every format and error, the chatterbot corpus).
"""
import importlib.util
import json
import os
import warnings
from dataclasses import dataclass
from pathlib import Path

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
    "chat" (messages: a tuple of {"role", "content", ...} dicts; tools: the record's tool schemas,
    passed to the chat template as transformers passes them, or None). source: where it came from."""
    kind: str
    source: str
    text: str = ""
    messages: tuple = ()
    tools: tuple = None
    instruction: str = ""
    input: str = ""
    output: str = ""


def load_records(path) -> list:
    """Records of a data file, or of every data file under a folder (recursive, sorted)."""
    path = Path(os.path.expanduser(str(path)))
    files = data_files(path)
    records = []
    for f in files:
        records.extend(_read_file(f))
    if not records:
        raise DataError(f"{path}: no records in {len(files)} file(s) (empty, or blank lines only): "
                        "add examples, or point --data at the files that hold them")
    return records


def data_files(path) -> list:
    """The data files of a file or folder (see the module docstring); DataError when there is
    nothing there, no data file, or a file of an unknown kind (checked before anything loads)."""
    path = Path(os.path.expanduser(str(path)))
    if not path.exists():
        raise DataError(f"data path {path} does not exist: pass a data file or a folder of them")
    files = [path] if path.is_file() else _data_files(path)
    if not files:
        raise DataError(f"{path} holds no data file: add {', '.join(SUFFIXES)} files")
    for f in files:
        if f.suffix.lower() not in SUFFIXES:
            raise DataError(f"{f}: unknown data file extension {f.suffix!r}: supported are "
                            f"{', '.join(SUFFIXES)}; rename the file or move it out of the data folder")
    return files


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
    return _read_document(f, _load_yaml(f))  # .yml / .yaml: data_files let no other suffix through


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
                raise DataError(f"{f}:{lineno}: malformed JSON ({e.msg.removesuffix(' at')} at column {e.colno}): "
                                "write one complete JSON object per line") from e
            records.extend(_parse_record(obj, f"{f}:{lineno}"))
    return records


def _load_json(f: Path):
    try:
        return json.loads(_text(f))
    except json.JSONDecodeError as e:
        raise DataError(f"{f}:{e.lineno}: malformed JSON ({e.msg.removesuffix(' at')} at column {e.colno}): fix the "
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
        return [Record("chat", source, messages=_check_messages(obj["messages"], source), tools=_tools(obj, source))]
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


def _tools(obj, source: str):
    """A chat record's "tools" (OpenAI-style function schemas, a list of objects), or None."""
    tools = obj.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise DataError(f"{source}: 'tools' must be a list of function schemas "
                        '({"type": "function", "function": {"name", "description", "parameters"}})')
    return tuple(tools)


def _check_messages(messages, source: str) -> tuple:
    """Messages as the chat template gets them: role and content checked, other keys (tool_calls,
    name, reasoning_content, tool_call_id ...) passed through as transformers passes them."""
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{source}: 'messages' must be a non-empty list of {{\"role\", \"content\"}}")
    out = []
    for j, m in enumerate(messages):
        call = isinstance(m, dict) and bool(m.get("tool_calls"))  # may omit content (gpt-oss's harmony chats do)
        if not isinstance(m, dict) or "role" not in m or ("content" not in m and not call):
            keys = sorted(map(str, m)) if isinstance(m, dict) else type(m).__name__
            raise DataError(f"{source}: message {j} needs 'role' and 'content' (found {keys}): "
                            'write {"role": "user" | "assistant" | "system", "content": "..."}')
        role, content = _string(m["role"], f"messages[{j}].role", source), m.get("content")
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
