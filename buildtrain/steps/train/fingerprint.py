"""Per-update fingerprints of the training state, computed where the tensors live and kept there
until the trace needs them: no copy to the host, no synchronisation, at any update in between.

A tensor is read as n words w_0 .. w_{n-1}: its bytes as signed 32-bit words (16- and 8-bit
dtypes as words of their own width, int16 and uint8), and its fingerprint is two sums:

    plain    = sum of w_q                    exact (|w| < 2**31, n < 2**32: below 2**63)
    weighted = sum of (q + 1) * w_q          modulo 2**64 (int64 wraparound)

Both are integer ring operations, so any order of summation, any thread count, any split into
blocks and any device gives the same two numbers; the CPU computes them in one pass of C
(`fingerprint.c`), a GPU with a few reductions over the tensors laid out in blocks (`in_blocks`).

What they detect, for certain: any change confined to one or two words of a tensor, swaps and
sign flips included. One word changed by d != 0 changes `plain` by d. Two words changed by d and
-d (anything else moves `plain`) change `weighted` by (q1 - q2) * d modulo 2**64, which is never
zero: d has at most 31 factors of two and (q1 - q2) at most 32 for tensors below 2**33 words, so
the product cannot be a multiple of 2**64. A change of three or more words escapes only if it
cancels in both sums at once; the differences a diverged training run leaves are spread over
many words, where that is as unlikely as two different 128-bit checksums agreeing by chance. The
record is for naming the first diverging update: the full blake3 digests are still taken at every
checkpoint and at the end, so nothing the output promises rests on these sums alone.
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Callable
from pathlib import Path

import attrs
import blake3
import torch

from buildtrain import native

SOURCE = Path(__file__).with_suffix(".c")
NARROW_VIEWS = {1: torch.uint8, 2: torch.int16}  # wider elements are read as 32-bit words
ROW = 128  # words per row of a block
BLOCK = ROW * ROW  # words per block; each tensor is padded with zeros (which add nothing) to blocks
# Tensors are fingerprinted on a GPU in groups of at most this many words (one int64 copy of
# 256 MiB at most; a larger tensor is a group of its own): a dozen kernels per group, not per tensor.
GROUP_WORDS = 1 << 25
HEX_CHARS = 16  # per tensor in the trace


def words(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor's bit patterns as a flat view of 8-, 16- or 32-bit words."""
    flat = tensor.detach().contiguous().reshape(-1)
    return flat.view(NARROW_VIEWS.get(flat.element_size(), torch.int32))


def lanes(tensors: list[torch.Tensor]) -> torch.Tensor:
    """(len(tensors), 2) int64 on the tensors' device: each tensor's (plain, weighted) sums. On
    the CPU in C where it is built; elsewhere (a GPU, or no compiler) with torch's reductions."""
    if not tensors:
        return torch.zeros(0, 2, dtype=torch.int64)
    compiled = _compiled()
    if tensors[0].device.type == "cpu" and compiled is not None:
        return in_c(compiled, tensors)
    # Tensors of one dtype of at most 4 bytes are their own words: no view per tensor (`words`
    # makes five: for 150 tensors, 0.38 ms of the host's time per update against 0.13 ms).
    alike = len({tensor.dtype for tensor in tensors}) == 1 and tensors[0].element_size() <= 4
    with torch.no_grad():
        return in_blocks(tensors if alike else [words(tensor) for tensor in tensors])


@functools.cache
def _compiled() -> Callable[..., None] | None:
    """`bt_fingerprint` from fingerprint.c, or None where there is no compiler or the build fails
    (torch's reductions then compute the same sums, only slower on the CPU)."""
    library = native.load_if_possible(SOURCE)
    if library is None:
        return None
    import ctypes  # only here: nothing that plans imports ctypes

    function = library.bt_fingerprint
    function.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_void_p]
    function.restype = None
    return function


def in_c(function: Callable[..., None], tensors: list[torch.Tensor]) -> torch.Tensor:
    """The sums by `bt_fingerprint`, reading each tensor's memory where it is (a few microseconds
    a tensor beyond the pass itself: no views are made, which cost more than small tensors' sums)."""
    out = torch.empty(len(tensors), 2, dtype=torch.int64)
    at = out.data_ptr()
    for index, tensor in enumerate(tensors):
        tensor = tensor if tensor.is_contiguous() else tensor.contiguous()  # kept alive for the call
        size = tensor.element_size()
        width = size if size < 4 else 4  # as `words` reads it
        function(tensor.data_ptr(), tensor.numel() * size // width, width, at + 16 * index)
    return out


def in_blocks(views: list[torch.Tensor]) -> torch.Tensor:
    """The sums with torch's reductions, group by group (see `_group_lanes`): of word views
    (`words`), or of tensors of one dtype of at most 4 bytes, whose elements are their words."""
    return torch.cat([_group_lanes(views[start:end]) for start, end in _groups(views)])


def _groups(views: list[torch.Tensor]) -> list[tuple[int, int]]:
    """Consecutive runs of views, each of at most GROUP_WORDS words (a larger one alone)."""
    groups: list[tuple[int, int]] = []
    size = 0
    for index, view in enumerate(views):
        if groups and size + view.numel() <= GROUP_WORDS:
            groups[-1] = (groups[-1][0], index + 1)
            size += view.numel()
        else:
            groups.append((index, index + 1))
            size = view.numel()
    return groups


def _group_lanes(views: list[torch.Tensor]) -> torch.Tensor:
    """(tensors, 2): the sums of a group, in two passes over one int32 copy of its words.

    Each tensor is laid out in blocks of ROW x ROW words. A word at block b of its tensor, row i,
    column c sits at position q = b * BLOCK + i * ROW + c, so (q + 1) * w splits into
    (b * BLOCK + i * ROW + 1) * w, summed through the rows' sums R, and c * w, summed through each
    block's column sums C: two plain reductions of the words, then arithmetic on R and C alone
    (R has one number per row of 128 words, C one per column of a block).
    """
    device = views[0].device
    layout = _layout(tuple(view.numel() for view in views), device)
    # Views of one dtype go in as they are (`reshape` views a contiguous one) and the whole is
    # read as words after the one copy; words of different widths are each widened to int32.
    alike = len({view.dtype for view in views}) == 1
    padding = torch.zeros(BLOCK, dtype=views[0].dtype if alike else torch.int32, device=device)
    pieces = []  # each tensor, then the zeros that fill its last block
    for view, blocks in zip(views, layout.blocks, strict=True):
        piece = view.reshape(-1) if alike else view.to(torch.int32)
        pieces += [piece, padding[: blocks * BLOCK - view.numel()]]
    joined = torch.cat(pieces)
    if alike:
        joined = joined.view(NARROW_VIEWS.get(joined.element_size(), torch.int32))
    # Widened to int64 once: torch's sum(dtype=int64) of int32 words makes an int64 copy of its
    # own first, and there are two sums. (One cat, as one batched kernel, then one widening
    # copy: a cat of int32 pieces straight into int64 takes torch's slow path, a copy per piece.)
    grid = joined.to(torch.int64).view(-1, ROW, ROW)  # (blocks, rows, columns)
    rows = grid.sum(dim=2)  # (blocks, ROW): R
    columns = grid.sum(dim=1)  # (blocks, ROW): C
    plain = rows.sum(dim=1)
    weighted = (rows * layout.row_weights).sum(dim=1) + (columns * layout.column_weights).sum(dim=1)
    per_block = torch.stack((plain, weighted), dim=1)  # (blocks, 2)
    running = torch.cat((per_block.new_zeros(1, 2), per_block.cumsum(dim=0)))  # wraps: a ring
    return running[layout.ends] - running[layout.starts]


@attrs.frozen(eq=False)
class _Layout:
    blocks: tuple[int, ...]  # per tensor
    row_weights: torch.Tensor  # (blocks, ROW): b * BLOCK + i * ROW + 1, b counted within its tensor
    column_weights: torch.Tensor  # (ROW,): c
    starts: torch.Tensor  # (tensors,): each tensor's first block
    ends: torch.Tensor  # (tensors,): past its last block


@functools.lru_cache(maxsize=16)
def _layout(sizes: tuple[int, ...], device: torch.device) -> _Layout:
    """A group's weights and bounds, made once per shape of group and device: a copy to a GPU
    from pageable memory waits for the GPU, so none may happen per update."""
    blocks = tuple(max(1, -(-size // BLOCK)) for size in sizes)
    within = torch.cat([torch.arange(count, dtype=torch.int64) for count in blocks])  # b per block
    row = torch.arange(ROW, dtype=torch.int64)
    row_weights = within[:, None] * BLOCK + row[None, :] * ROW + 1
    ends = torch.tensor(blocks).cumsum(0)
    return _Layout(
        blocks=blocks,
        row_weights=row_weights.to(device),
        column_weights=row.to(device),
        starts=(ends - torch.tensor(blocks)).to(device),
        ends=ends.to(device),
    )


def hex_digest(plain: int, weighted: int) -> str:
    """A tensor's two sums as the trace writes them: a blake3 prefix of their 16 bytes."""
    return blake3.blake3(struct.pack("<2q", plain, weighted)).hexdigest()[:HEX_CHARS]


class Pending:
    """Fingerprints of updates taken on the device and not yet read: `add` launches the
    reductions and returns at once; `take` copies every pending one to the host in one transfer
    (the one synchronisation) and returns each as {tensor name: hex}, in the order added.

    Weights that do not train (LoRA's base model) are fingerprinted once, while each stays the
    same memory at the same version (torch bumps the version at every in-place write)."""

    def __init__(self, frozen: set[str] | frozenset[str] = frozenset()) -> None:
        self.frozen = frozen
        self.known: dict[str, tuple[torch.Tensor, int, torch.Tensor]] = {}  # tensor, version, sums
        self.updates: list[tuple[list[str], torch.Tensor]] = []

    def __len__(self) -> int:
        return len(self.updates)

    def add(self, tensors: dict[str, torch.Tensor]) -> None:
        names = sorted(tensors)
        fresh = [name for name in names if not self._known(name, tensors[name])]
        kept = [name for name in names if name not in fresh]
        computed = lanes([tensors[name] for name in fresh])
        for index, name in enumerate(fresh):
            if name in self.frozen:
                self.known[name] = (tensors[name], tensors[name]._version, computed[index])
        if kept:
            computed = torch.cat((computed, torch.stack([self.known[name][2] for name in kept])))
        self.updates.append((fresh + kept, computed))

    def _known(self, name: str, tensor: torch.Tensor) -> bool:
        held = self.known.get(name)
        if held is None or held[1] != tensor._version:
            return False
        same = (held[0].data_ptr(), held[0].dtype, held[0].shape, held[0].stride())
        return same == (tensor.data_ptr(), tensor.dtype, tensor.shape, tensor.stride())

    def take(self) -> list[dict[str, str]]:
        if not self.updates:
            return []
        sums = torch.cat([computed for _, computed in self.updates]).cpu().tolist()  # one sync
        found, at = [], 0
        for names, _ in self.updates:
            found.append({name: hex_digest(*sums[at + i]) for i, name in enumerate(names)})
            at += len(names)
        self.updates = []
        return found
