"""tokenizer.json and tokenizer_config.json from a GGUF file's metadata (lean/runtime/gguf.py's
converter writes them next to the weights).

Byte-level BPE ("gpt2" tokenizer model) only: vocabulary from tokenizer.ggml.tokens, merges, the
pre-tokenizer named by tokenizer.ggml.pre (gpt2/default; smollm-style digit splitting, as llama.cpp
does; Llama 3's split), token_type 3 (control) and 4 (user-defined) as added tokens, a ByteLevel
decoder, and BOS added when the metadata asks. Anything else raises GGUFError naming the key.
"""
from pathlib import Path

from .gguf import GGUFError

# Pre-tokenizers: tokenizer.ggml.pre -> how text is split before the BPE merges.
_GPT2_PRE = ("default", "gpt2", None)
_DIGITS_PRE = ("smollm", "starcoder", "refact", "codeshell")
_LLAMA3_PRE = ("llama-bpe", "llama3", "llama-v3")
_LLAMA3_SPLIT = (  # Llama 3's tokenizer.json split (as in transformers' GGUF tokenizer mapping)
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
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
    from tokenizers import Regex, pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _GPT2_PRE:
        return byte_level
    if pre in _DIGITS_PRE:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in _LLAMA3_PRE:
        return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    supported = [p for p in (*_GPT2_PRE, *_DIGITS_PRE, *_LLAMA3_PRE) if p]
    raise GGUFError(f"{src}: tokenizer.ggml.pre={pre!r} is not supported by lean's GGUF converter "
                    f"(supported: {', '.join(supported)}): use the HF release's tokenizer.json")


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
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = _pre_tokenizer(meta.get("tokenizer.ggml.pre"), src)
    tok.decoder = decoders.ByteLevel()
    # control tokens written outside the byte alphabet are llama.cpp mislabels: left as normal tokens
    special = [t for t, ty in zip(tokens, types) if ty == _CONTROL and set(t) <= alphabet]
    user = [t for t, ty in zip(tokens, types) if ty == _USER_DEFINED and t in vocab]
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in special])
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])
    tok.post_processor = _post_processor(meta, tokens)
    return tok.to_str()


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
