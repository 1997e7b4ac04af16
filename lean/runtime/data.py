"""The data pipeline of lean-train: files -> records -> token documents -> packed batches.

    records = load_records("data/")                       # a file, or a folder read recursively
    docs = tokenize_records(records, tok, max_len=2048)    # [(ids, mask)], numpy int32 / bool
    train, heldout = split_heldout(docs, 0.05, seed=0)
    for docs_b in pack_batches(train, max_tokens=8192, seed=epoch): batch = lean.pack(docs_b, 8192)

Files and record shapes: records.py (load_records, Record, DataError are re-exported here).

Loss masks (mask[t] = 1: token t is a target, predicted from token t-1; see batch.py):
  text          every token; tokenizer.json's post-processor adds its special tokens (BOS for
                Llama 3, nothing for SmolLM2) and EOS is appended (unless the post-processor added
                it); cut into windows of max_len
  chat          assistant turns only. The assistant character spans come from rendering prefixes:
                render(messages[:i], add_generation_prompt=True) is a prefix of
                render(messages[:i+1]) for an assistant message i, and the span lies between their
                lengths, so the end-of-turn token (<|im_end|>, <|eot_id|>) is a target and the
                model learns to stop. A token is a target when its character offsets overlap a span.
                Templates that render a turn from the turns after it (gpt-oss's harmony: the last
                assistant turn ends in <|return|>, the others in <|end|>; reasoning before a tool
                call is dropped once a final answer follows) break that prefix rule; for them the
                turns are found by their markers: the generation prompt G (what
                add_generation_prompt appends, "<|start|>assistant") opens an assistant turn, which
                runs to the next turn opener (G's first token, "<|start|>"); a chat with fewer G
                turns than assistant messages raises. A record's "tools" go to the template.
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
import warnings

import numpy as np

from .records import SUFFIXES, DataError, DataWarning, Record, default_dataset, load_records
from .tokenizer import TokenizerError

__all__ = ["SUFFIXES", "DataError", "DataWarning", "Record", "default_dataset", "load_records",
           "tokenize_records", "pack_batches", "split_heldout"]

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
        except (DataError, TokenizerError):  # already name their cause and fix
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
    if counts["truncated"] or counts["dropped"]:  # lean-train prints it as one line (cli.py)
        warnings.warn(f"{counts['truncated']} of {counts['records']} records were cut at {max_len} tokens "
                      f"(--max-tokens) and {counts['dropped']} documents were left with no target token and "
                      "dropped: raise --max-tokens to keep them whole", DataWarning, stacklevel=2)
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
    text, spans = _assistant_spans(tok, messages, rec.source, rec.tools)
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


def _assistant_spans(tok, messages, source: str, tools=None):
    """The rendered chat and the character spans [start, end) of its assistant turns."""
    messages = list(messages)
    render = lambda ms, gen=False: tok.apply_chat_template(ms, add_generation_prompt=gen, tools=tools)  # noqa: E731
    full = render(messages)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = render(messages[:i], True)
        upto = full if i == len(messages) - 1 else render(messages[:i + 1])
        if not (upto.startswith(before) and full.startswith(upto)):
            return full, _marker_spans(tok, messages, full, render, source)
        spans.append((len(before), len(upto)))
    return full, spans


def _marker_spans(tok, messages, full, render, source: str):
    """Assistant spans of a template that renders turns from the turns after them: each from the
    end of a generation prompt G in `full` to the next turn opener (G's first token)."""
    first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
    plain = render(messages[:first]) if first else ""
    prompt = render(messages[:first], True)
    G = prompt[len(plain):] if prompt.startswith(plain) else ""
    ids, offsets = tok.encode_with_offsets(G) if G else ([], [])
    opener = G[offsets[0][0]:offsets[0][1]] if ids else ""
    if not (G and opener and full.startswith(prompt)):
        raise DataError(
            f"{source}: the chat template does not render assistant turn {first} as an extension of "
            "the turns before it (it rewrites earlier turns, or the chat starts with an "
            "assistant message), so its loss mask cannot be found: start chats with a user or "
            "system turn, or use a template whose prefixes render unchanged")
    spans, at = [], len(plain)
    while (p := full.find(G, at)) >= 0:
        start = p + len(G)
        end = full.find(opener, start)
        end = len(full) if end < 0 else end
        spans.append((start, end))
        at = end
    n_assistant = sum(m["role"] == "assistant" for m in messages)
    if len(spans) < n_assistant:
        raise DataError(f"{source}: the chat renders {len(spans)} assistant turn(s) opened by {G!r} for "
                        f"{n_assistant} assistant message(s), so its loss mask cannot be found: check the "
                        "messages' roles against the model's chat template")
    return spans


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


def split_heldout(docs, fraction: float, seed: int = 0, max_tokens: int = None):
    """(train, heldout): a seeded random `fraction` of docs held out, original order kept in both.

    At least one document is held out when fraction > 0 and there are 2 or more documents.
    max_tokens caps the held-out set: it takes the drawn documents in their drawn order while they
    fit in max_tokens tokens (at least one), and the rest train.
    """
    if not 0.0 <= fraction < 1.0:
        raise DataError(f"held-out fraction {fraction} is outside [0, 1): pass e.g. 0.05")
    n = len(docs)
    k = 0 if fraction == 0 or n < 2 else min(n - 1, max(1, round(fraction * n)))
    drawn = np.random.default_rng(seed).permutation(n)[:k].tolist()  # sync: none (numpy on the host)
    if max_tokens is not None:
        total, k = 0, 0
        for i in drawn:
            total += _doc_len(docs[i])
            if k and total > max_tokens:
                break
            k += 1
        drawn = drawn[:k]
    held = set(drawn)
    train = [d for i, d in enumerate(docs) if i not in held]
    heldout = [d for i, d in enumerate(docs) if i in held]
    return train, heldout
