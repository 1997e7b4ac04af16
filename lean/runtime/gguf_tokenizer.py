"""tokenizer.json and tokenizer_config.json from a GGUF file's metadata (lean/runtime/gguf.py's
converter writes them next to the weights).

Byte-level BPE ("gpt2" tokenizer model) only: vocabulary from tokenizer.ggml.tokens, merges, the
pre-tokenizer named by tokenizer.ggml.pre (gguf_names.PRE: gpt2/default; smollm-style digit
splitting, as llama.cpp does; Llama 3's split; Qwen2's, with the NFC normalizer Qwen's releases
ship; o200k's "gpt-4o"), token_type 3 (control) and 4 (user-defined) as added tokens, a ByteLevel
decoder, and BOS added when the metadata asks. Anything else raises GGUFError naming the key.
"""
import json
from pathlib import Path

from .gguf import GGUFError
from .gguf_names import PRE, PRE_ALIASES

_CONTROL, _USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values


def _bytes_to_unicode() -> dict:
    """GPT-2's byte -> printable character table (the ByteLevel alphabet)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _pre_tokenizer(pre, src: Path):
    """(normalizer, pre_tokenizer) in tokenizer.json's form for tokenizer.ggml.pre (gguf_names.PRE)."""
    name = PRE_ALIASES.get(pre, pre)
    if name not in PRE:
        supported = [p for p in (*PRE, *PRE_ALIASES) if p]
        raise GGUFError(f"{src}: tokenizer.ggml.pre={pre!r} is not supported by lean's GGUF converter "
                        f"(supported: {', '.join(supported)}): use the HF release's tokenizer.json")
    return PRE[name]


def tokenizer_json(meta: dict, src: Path) -> str:
    """tokenizer.json text for the byte-level BPE tokenizer the metadata describes."""
    from tokenizers import AddedToken, Tokenizer, decoders, models

    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise GGUFError(f"{src}: tokenizer.ggml.model={kind!r}; lean's GGUF converter builds byte-level BPE "
                        "('gpt2') tokenizers only (SentencePiece 'llama' vocabularies are not supported): "
                        "use the HF release's tokenizer.json")
    tokens = meta.get("tokenizer.ggml.tokens")
    merges = meta.get("tokenizer.ggml.merges")
    if not tokens or merges is None:
        raise GGUFError(f"{src}: tokenizer.ggml.tokens or tokenizer.ggml.merges is missing: no tokenizer to build")
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())

    def spelled(tok):  # tokens outside the byte alphabet are stored as text: spell their UTF-8 bytes
        return tok if set(tok) <= alphabet else "".join(spelling[b] for b in tok.encode("utf-8"))

    vocab = {spelled(tok): i for i, tok in enumerate(tokens)}
    bpe = models.BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges], fuse_unk=False)
    normalizer, pre_tokenizer = _pre_tokenizer(meta.get("tokenizer.ggml.pre"), src)
    tok = Tokenizer(bpe)
    tok.decoder = decoders.ByteLevel()
    # control tokens written outside the byte alphabet are llama.cpp mislabels: left as normal tokens
    special = [t for t, ty in zip(tokens, types) if ty == _CONTROL and set(t) <= alphabet]
    user = [t for t, ty in zip(tokens, types) if ty == _USER_DEFINED and t in vocab]
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in special])
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])
    tok.post_processor = _post_processor(meta, tokens)
    data = json.loads(tok.to_str())
    data["normalizer"], data["pre_tokenizer"] = normalizer, pre_tokenizer
    return Tokenizer.from_str(json.dumps(data)).to_str()  # parsed once: the table's JSON is checked


def _post_processor(meta: dict, tokens: list):
    """BOS/EOS around each sequence when add_bos_token / add_eos_token say so (transformers' layout)."""
    from tokenizers import processors

    ends, special = {}, []
    for name in ("bos", "eos"):
        token_id = meta.get(f"tokenizer.ggml.{name}_token_id")
        if meta.get(f"tokenizer.ggml.add_{name}_token") and token_id is not None:
            ends[name] = tokens[int(token_id)]
            special.append((tokens[int(token_id)], int(token_id)))

    def seq(x, type_id):
        parts = [f"${x}:{type_id}"]
        if "bos" in ends:
            parts.insert(0, f"{ends['bos']}:{type_id}")
        if "eos" in ends:
            parts.append(f"{ends['eos']}:{type_id}")
        return " ".join(parts)

    return processors.TemplateProcessing(single=seq("A", 0), pair=f"{seq('A', 0)} {seq('B', 1)}",
                                         special_tokens=special)


def tokenizer_config(meta: dict, config: dict) -> dict:
    tokens = meta.get("tokenizer.ggml.tokens") or []
    out = {"tokenizer_class": "PreTrainedTokenizerFast",
           "model_max_length": config["max_position_embeddings"],
           "clean_up_tokenization_spaces": False,
           "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
           "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False))}
    for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                      ("pad_token", "padding_token_id"), ("unk_token", "unknown_token_id")):
        token_id = meta.get(f"tokenizer.ggml.{key}")
        if token_id is not None and 0 <= int(token_id) < len(tokens):
            out[name] = tokens[int(token_id)]
    template = meta.get("tokenizer.chat_template")
    named = {k[len("tokenizer.chat_template."):]: v for k, v in meta.items()
             if k.startswith("tokenizer.chat_template.")}
    if named:  # transformers' list form; "default" is the plain tokenizer.chat_template
        out["chat_template"] = ([{"name": "default", "template": template}] if template else []) + \
                               [{"name": n, "template": t} for n, t in sorted(named.items())]
    elif template:
        out["chat_template"] = template
    return out
