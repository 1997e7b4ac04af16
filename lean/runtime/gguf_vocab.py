"""A model folder's tokenizer as GGUF metadata (tokenizer.ggml.*, tokenizer.chat_template): what
llama.cpp, Ollama and LM Studio tokenize and chat with. The inverse of gguf_tokenizer.py.

    meta = vocab_metadata(folder, vocab_size=cfg.vocab)   # {key: (value, GGUFValueType)}
    for key, (value, vtype) in meta.items(): writer.add_key_value(key, value, vtype, ...)

Read from the folder (as data; transformers is not imported):
  tokenizer.json         model.vocab + model.merges (byte-level BPE only), added_tokens, the
                         pre_tokenizer (-> tokenizer.ggml.pre through gguf_names.PRE: the split
                         llama.cpp must reproduce), the post_processor (does it add BOS / EOS?)
  tokenizer_config.json  bos/eos/pad/unk tokens, add_bos_token / add_eos_token, chat_template
                         (a string, or named templates as a list)
  chat_template.jinja    the template where tokenizer_config.json has none (transformers 5 layout)
  config.json            bos/eos/pad ids where tokenizer_config.json names none
Written:
  tokenizer.ggml.model "gpt2", .pre, .tokens (vocab_size of them: ids the tokenizer lacks become
  "[PAD<id>]", type UNUSED, as llama.cpp's converter writes them), .token_type (NORMAL; an added
  special token CONTROL, another added token USER_DEFINED), .merges ("a b"), bos/eos/pad/unk ids,
  add_bos_token / add_eos_token (always written, so llama.cpp's per-pre-tokenizer default never
  applies), tokenizer.chat_template (+ .<name> for named ones).

Errors are GGUFError naming the file and the fix: no tokenizer.json, a model other than BPE
(SentencePiece, WordLevel, ...), a pre-tokenizer or normalizer llama.cpp does not reproduce, a token
id past vocab_size.
Tested: tests/test_gguf_export.py (the SmolLM2 GGUF's own vocabulary, merges, ids and template come
back from lean's HF folder of it; each pre-tokenizer of the table; the refusals).
"""
import json
from pathlib import Path

from gguf import GGUFValueType, Keys, TokenType

from .gguf import GGUFError
from .gguf_names import PRE, pre_name

K = Keys.Tokenizer
S, U32, BOOL, ARR = GGUFValueType.STRING, GGUFValueType.UINT32, GGUFValueType.BOOL, GGUFValueType.ARRAY


def _read_json(path: Path, required=False):
    if not path.is_file():
        if required:
            raise GGUFError(f"{path.parent} has no {path.name}: the GGUF needs the model's tokenizer; copy the "
                            "base model's tokenizer files into the model folder")
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except ValueError as e:
        raise GGUFError(f"{path} is not valid JSON ({e}): copy it again from the base model") from e


def _content(token):
    """A tokenizer_config special token: a string, or {"content": ...} (AddedToken's form)."""
    return token.get("content") if isinstance(token, dict) else token


def _chat_template(folder: Path, tok_cfg: dict):
    template = tok_cfg.get("chat_template")
    if template is None and (folder / "chat_template.jinja").is_file():
        template = (folder / "chat_template.jinja").read_text(encoding="utf-8")
    return template


def _adds(post: dict, token: str, first: bool) -> bool:
    """Whether a TemplateProcessing post-processor puts `token` first (BOS) or last (EOS)."""
    if not post or not token:
        return False
    steps = post.get("processors", [post]) if post.get("type") == "Sequence" else [post]
    for p in steps:
        if p.get("type") == "TemplateProcessing" and p.get("single"):
            end = p["single"][0 if first else -1]
            if end.get("SpecialToken", {}).get("id") == token:
                return True
    return False


def vocab_metadata(folder, vocab_size: int) -> dict:
    """{GGUF key: (value, GGUFValueType, sub type or None)} of the tokenizer in `folder`."""
    folder = Path(folder)
    tj = _read_json(folder / "tokenizer.json", required=True)
    tok_cfg = _read_json(folder / "tokenizer_config.json")
    config = _read_json(folder / "config.json")
    model = tj.get("model") or {}
    if model.get("type") != "BPE" or not isinstance(model.get("vocab"), dict):
        raise GGUFError(f"{folder / 'tokenizer.json'}: a {model.get('type')!r} tokenizer; the GGUF export writes "
                        "byte-level BPE tokenizers (Llama 3, SmolLM, Qwen, GPT-OSS) only: train on such a model")
    pre = pre_name(tj.get("pre_tokenizer"))
    normalizer = (tj.get("normalizer") or {}).get("type")
    if pre is None or normalizer not in (None, "NFC"):
        shown = json.dumps(tj.get("pre_tokenizer"))[:200]
        raise GGUFError(f"{folder / 'tokenizer.json'}: pre_tokenizer {shown} (normalizer {normalizer}) is none of "
                        f"the splits llama.cpp reproduces ({', '.join(PRE)}): llama.cpp would tokenize text "
                        "differently from the model's training; export a model with one of those tokenizers")
    tokens, types = [None] * vocab_size, [TokenType.UNUSED] * vocab_size
    added = {t["id"]: t for t in tj.get("added_tokens") or []}
    for text, i in model["vocab"].items():
        tokens[_index(i, vocab_size, text, folder)] = text
        types[i] = TokenType.NORMAL
    for i, t in added.items():
        tokens[_index(i, vocab_size, t["content"], folder)] = t["content"]
        types[i] = TokenType.CONTROL if t.get("special") else TokenType.USER_DEFINED
    for i, t in enumerate(tokens):
        if t is None:
            tokens[i] = f"[PAD{i}]"
    ids = {t: i for i, t in enumerate(tokens)}
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
    meta = {K.MODEL: ("gpt2", S, None), K.PRE: (pre, S, None), K.LIST: (tokens, ARR, S),
            K.TOKEN_TYPE: ([int(t) for t in types], ARR, GGUFValueType.INT32), K.MERGES: (merges, ARR, S)}
    special = {}
    for name, key, hf_id in (("bos", K.BOS_ID, "bos_token_id"), ("eos", K.EOS_ID, "eos_token_id"),
                             ("pad", K.PAD_ID, "pad_token_id"), ("unk", K.UNK_ID, None)):
        text = _content(tok_cfg.get(f"{name}_token"))
        token_id = ids.get(text) if text is not None else None
        if token_id is None and hf_id is not None and config.get(hf_id) is not None:
            token_id = config[hf_id][0] if isinstance(config[hf_id], list) else config[hf_id]
        if token_id is not None:
            meta[key] = (int(token_id), U32, None)
            special[name] = tokens[int(token_id)]
    post = tj.get("post_processor") or {}
    for name, key, first in (("bos", K.ADD_BOS, True), ("eos", K.ADD_EOS, False)):
        flag = tok_cfg.get(f"add_{name}_token")
        meta[key] = (bool(flag) if flag is not None else _adds(post, special.get(name), first), BOOL, None)
    template = _chat_template(folder, tok_cfg)
    if isinstance(template, list):  # named templates: "default" is tokenizer.chat_template
        for t in template:
            name = "".join(c if c.isalnum() else "_" for c in t["name"])
            meta[K.CHAT_TEMPLATE if name == "default" else K.CHAT_TEMPLATE_N.format(name=name)] = (t["template"], S, None)
    elif template:
        meta[K.CHAT_TEMPLATE] = (template, S, None)
    return meta


def _index(i, vocab_size, text, folder):
    if not 0 <= i < vocab_size:
        raise GGUFError(f"{folder / 'tokenizer.json'}: token {text!r} has id {i}, past the model's vocab_size "
                        f"{vocab_size} (config.json): the tokenizer belongs to another model")
    return i
