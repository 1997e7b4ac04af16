"""The batch descriptor: built once per batch on the host, read by every layer.

Documents (token-id lists, each optionally with a per-token loss mask) are packed end to end into
one row of N tokens. Every layer reads the same descriptor: no per-layer rebuild, and nothing in
the step reads back from the device.

  ids         (N,)   int32  token ids
  positions   (N,)   int32  0, 1, ... restarting at every document (RoPE)
  targets     (N,)   int32  the next token of the same document, or -100 (last token of a
                            document, masked tokens, padding): no target crosses a boundary
  cu_seqlens  (B+1,) int32  document b is rows cu_seqlens[b]:cu_seqlens[b+1]
  max_seqlen  host int      the longest document (sizes the attention grid)
  n_targets   host int      tokens that carry a loss (known on the host: no sync to normalise)

The four int32 arrays travel to the device in ONE non-blocking copy from a pinned host buffer.
RoPE tables (cos, sin) are built from `positions` once per batch by the step's prologue.

Fixed shapes (for a captured CUDA graph, lean/runtime/graph.py): pack(..., pad_to=T, max_docs=D)
always gives N = T tokens, cu_seqlens of D+1 entries and max_seqlen = T. The tokens past the real
documents form one padding document (ids 0, every target ignored: it attends only to itself and
adds exactly zero to the loss and the gradients); the unused slots are documents of length 0 at
the end. `PinnedUpload` is the persistent device tensor a graph reads, written from the host
through two pinned buffers in turn.
"""
from dataclasses import dataclass, field

import numpy as np
import torch

IGNORE = -100


class BatchError(ValueError):
    pass


@dataclass
class Batch:
    ids: torch.Tensor
    positions: torch.Tensor
    targets: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int
    n_tokens: int
    n_targets: int
    doc_lens: list
    host: np.ndarray  # the packed int32 host copy [ids | positions | targets | cu_seqlens]
    cache: dict = field(default_factory=dict)  # per-batch tables the step builds once (RoPE)

    @property
    def device(self):
        return self.ids.device


def _doc_parts(doc, i):
    """A document is a token-id list, (ids, mask), or a dict with ids/input_ids and mask/loss_mask."""
    mask = None
    if isinstance(doc, dict):
        ids = doc.get("ids", doc.get("input_ids"))
        mask = doc.get("mask", doc.get("loss_mask"))
        if ids is None:
            raise BatchError(f"document {i}: a dict document needs 'ids' (or 'input_ids')")
    elif isinstance(doc, tuple) and len(doc) == 2:
        ids, mask = doc
    else:
        ids = doc
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    if mask is not None:
        mask = np.asarray(mask, dtype=bool).reshape(-1)
        if mask.shape != ids.shape:
            raise BatchError(f"document {i}: loss mask has {mask.size} entries for {ids.size} tokens")
    return ids, mask


def pack(docs, max_tokens, *, device=None, pad_to=None, vocab=None, max_docs=None):
    """Pack documents into one batch descriptor.

    docs: list of documents (see _doc_parts). mask[t] = 1 means token t is a target (its
    prediction from token t-1 counts in the loss); without a mask every token after a document's
    first is a target. max_tokens: the token budget; a longer document or a larger total is an
    error naming the fix. pad_to: pad the row to this many tokens with an ignored filler document.
    max_docs (needs pad_to): fixed shapes for graph capture -- cu_seqlens gets max_docs + 1
    entries (empty documents fill the unused slots; the filler document takes a slot) and
    max_seqlen = pad_to. vocab: if given, ids are checked against it here on the host.
    """
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if torch.device(device).type not in ("cuda", "cpu"):  # the batch would land on the CPU unsaid
        raise BatchError(f"device {device!r}: lean's kernels run on a CUDA GPU or (Triton's interpreter) the CPU")
    if len(docs) == 0:
        raise BatchError("empty batch: pack() needs at least one document")
    parts = [_doc_parts(d, i) for i, d in enumerate(docs)]
    lens = [len(ids) for ids, _ in parts]
    for i, n in enumerate(lens):
        if n == 0:
            raise BatchError(f"document {i} is empty: drop empty documents before packing")
        if n > max_tokens:
            raise BatchError(f"document {i} has {n} tokens, more than the token budget max_tokens={max_tokens}: "
                             "raise max_tokens or cut the document into windows")
    total = sum(lens)
    if total > max_tokens:
        raise BatchError(f"{len(docs)} documents hold {total} tokens, more than max_tokens={max_tokens}: "
                         "split them over several batches (lean.pack_batches) or raise max_tokens")
    if pad_to is not None:
        if pad_to < total:
            raise BatchError(f"pad_to={pad_to} is smaller than the {total} tokens packed")
        if pad_to > total:
            parts.append((np.zeros(pad_to - total, dtype=np.int64), np.zeros(pad_to - total, dtype=bool)))
            lens.append(pad_to - total)
    if max_docs is not None:
        _fill_doc_slots(parts, lens, max_docs, pad_to, n_docs=len(docs))
    N, B = sum(lens), len(lens)

    host = np.empty(3 * N + B + 1, dtype=np.int32)
    ids_h, pos_h, tgt_h, cu_h = host[:N], host[N:2 * N], host[2 * N:3 * N], host[3 * N:]
    cu_h[0] = 0
    np.cumsum(lens, out=cu_h[1:])
    for b, (ids, mask) in enumerate(parts):
        s, e = cu_h[b], cu_h[b + 1]
        if vocab is not None and ids.size and (ids.min() < 0 or ids.max() >= vocab):
            raise BatchError(f"document {b}: token id out of range [0, {vocab})")
        ids_h[s:e] = ids
        pos_h[s:e] = np.arange(e - s, dtype=np.int32)
        nxt = np.full(e - s, IGNORE, dtype=np.int64)
        nxt[:-1] = ids[1:]
        if mask is not None:
            nxt[:-1][~mask[1:]] = IGNORE
        tgt_h[s:e] = nxt
    n_targets = int((tgt_h != IGNORE).sum())

    dev = torch.device(device)
    host_t = torch.from_numpy(host)
    if dev.type == "cuda":
        host_t = host_t.pin_memory()
        dev_t = torch.empty(host.size, dtype=torch.int32, device=dev)
        dev_t.copy_(host_t, non_blocking=True)  # the one host -> device copy of the descriptor
    else:
        dev_t = host_t.clone()
    return Batch(
        ids=dev_t[:N], positions=dev_t[N:2 * N], targets=dev_t[2 * N:3 * N], cu_seqlens=dev_t[3 * N:],
        max_seqlen=N if max_docs is not None else int(max(lens)),  # fixed shapes: the whole row
        n_tokens=N, n_targets=n_targets, doc_lens=lens, host=host,
    )


def count_tokens(docs) -> tuple:
    """(n_tokens, n_targets) that pack(docs) would give, counted on the host without packing: every
    document's tokens; its tokens after the first, those whose mask is set where it has one, as
    targets. Data-parallel ranks count every rank's micro-batches of a step with it (runtime/dist.py)."""
    tokens = targets = 0
    for i, doc in enumerate(docs):
        ids, mask = _doc_parts(doc, i)
        tokens += len(ids)
        targets += max(len(ids) - 1, 0) if mask is None else int(mask[1:].sum())
    return tokens, targets


def _fill_doc_slots(parts, lens, max_docs, pad_to, n_docs):
    """Append empty documents until there are max_docs (in place): a fixed cu_seqlens length."""
    if pad_to is None:
        raise BatchError("max_docs fixes the shapes for graph capture and needs pad_to (the fixed "
                         "token count): pass pad_to=max_tokens")
    if len(lens) > max_docs:
        filler = " and the padding document" if len(lens) > n_docs else ""
        raise BatchError(f"{n_docs} documents{filler} need {len(lens)} document slots, more than "
                         f"max_docs={max_docs}: raise max_docs or put fewer documents in a batch")
    for _ in range(max_docs - len(lens)):
        parts.append((np.zeros(0, dtype=np.int64), None))
        lens.append(0)


class PinnedUpload:
    """A persistent device tensor `dev` written from the host with no round trip to the device.

    write(values) fills one of two pinned host buffers, used in turn, and enqueues a non-blocking
    copy into `dev` on the current stream; an event recorded after each copy guards its buffer.
    Before a buffer is refilled the host waits on its event: it blocks only when it has run two
    writes ahead of the device (a bound on run-ahead, never a wait for the step just enqueued).
    A captured CUDA graph reads `dev` on replay, so write before replay. On the CPU the copy is
    plain and synchronous.
    Caution: `dev` holds one value at a time: work enqueued after a write reads that write's
    value, so write right before the launch or replay that needs it.
    """

    def __init__(self, n, dtype, device):
        self.dev = torch.zeros(n, dtype=dtype, device=device)
        cuda = self.dev.is_cuda
        self._host = [torch.zeros(n, dtype=dtype, pin_memory=cuda) for _ in range(2)]
        self._done = [torch.cuda.Event() if cuda else None for _ in range(2)]
        self._turn = 0

    def write(self, values):
        """dev <- values (anything numpy can assign to the buffer: an array, a list, a scalar)."""
        i, self._turn = self._turn, 1 - self._turn
        if self._done[i] is not None:
            self._done[i].synchronize()  # the copy from this buffer two writes ago (see the class)
        self._host[i].numpy()[:] = values
        self.dev.copy_(self._host[i], non_blocking=True)
        if self._done[i] is not None:
            self._done[i].record()
        return self.dev
