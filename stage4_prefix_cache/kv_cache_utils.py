"""Block hashes, the KV block record, and the free-block queue.

Stage 4 adds automatic prefix caching. Two requests that begin with the same
tokens produce the same keys and values for that beginning, so the engine can
compute them once and let both requests point their block tables at the same
physical blocks. This module holds the three small pieces everything else is
built from:

- ``hash_block_tokens``: the identity of one full block, chained to the block
  before it, so "these four tokens" means "these four tokens *after exactly
  this prefix*" (plus extra keys: whatever else decides the block's K/V).
- ``KVCacheBlock``: one physical block's bookkeeping (id, reference count,
  hash once full, and links for the free queue).
- ``FreeKVCacheBlockQueue``: a doubly linked list of blocks nobody is using.
  Blocks in it still keep their cached contents until they are popped for
  reuse, so it doubles as the LRU eviction order.

vLLM counterpart: ``vllm/v1/core/kv_cache_utils.py``.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

# A block hash is the digest bytes of the hash function in use: 32 bytes for
# "sha256", 8 for "fast". vLLM likewise uses raw digest bytes (``BlockHash``).
BlockHash = bytes

# A hash function maps the canonical byte encoding of a block to a digest.
HashFn = Callable[[bytes], BlockHash]

# One extra key: (source tag, value). The tag says where the value came from. The
# seeds' formula is ``block_hash = H(parent_hash, block_tokens, extra_hashes)`` with
# ``extra_hashes = LoRA IDs + multimodal hashes + optional cache_salt``: stage 4 has one
# source, "salt" (the request's cache salt, a trust group chosen by a gateway); the
# systems of a later stage add theirs through ``KVCacheManager.block_extra_keys``.
ExtraKey = tuple[str, "str | bytes | int"]


# ---------------------------------------------------------------------------
# Hash functions
# ---------------------------------------------------------------------------


def sha256_hash(data: bytes) -> BlockHash:
    """SHA-256 of ``data`` (32 bytes). The default, as in vLLM.

    A cryptographic hash: nobody knows how to construct two inputs with the
    same digest, so one tenant cannot craft a prompt whose block hash equals
    another tenant's and read that tenant's cached KV.
    """
    return hashlib.sha256(data).digest()


def fast_hash(data: bytes) -> BlockHash:
    """Python's built-in ``hash()`` of ``data``, as 8 bytes. Not cryptographic.

    CPython hashes ``bytes`` with SipHash-1-3 under a per-process random key,
    which is fast (tens of nanoseconds) and spreads values well, but:

    - The digest is only 64 bits. By the birthday bound, a cache holding N
      distinct hashes has roughly N**2 / 2**65 chance that two of them collide.
      A collision means one request silently reads KV computed for different
      tokens, so its output is wrong.
    - It is not collision resistant against an adversary. With 64 bits, a
      brute-force birthday search is about 2**32 work, and SipHash-1-3 is a
      reduced-round variant chosen for speed. In a multi-tenant server a
      deliberate collision is a cross-tenant data leak, so use "sha256" there.
    - The key changes between processes (unless ``PYTHONHASHSEED`` is fixed),
      so these hashes mean nothing outside the process that made them. That
      is fine here: the prefix cache lives in one process.

    Use it for single-tenant or benchmark settings where hashing time matters.
    """
    return (hash(data) & 0xFFFF_FFFF_FFFF_FFFF).to_bytes(8, "big")


_HASH_FUNCTIONS: dict[str, HashFn] = {"sha256": sha256_hash, "fast": fast_hash}


def get_hash_fn(name: str) -> HashFn:
    """The block hash function called ``name``: "sha256" (default) or "fast"."""
    try:
        return _HASH_FUNCTIONS[name]
    except (KeyError, TypeError):
        raise ValueError(f"hash_fn: must be one of {sorted(_HASH_FUNCTIONS)}, got {name!r}") from None


# ---------------------------------------------------------------------------
# Canonical encoding of a block's identity
# ---------------------------------------------------------------------------
#
# The hash function only ever sees bytes, so two different identities must
# never encode to the same bytes: no hash, however strong, can tell apart two
# inputs that are already equal. Older vLLM (v0.28) made exactly that mistake
# with extra keys: it concatenated adapter names, image hashes and the salt
# into one untagged tuple, so an adapter called "tenant-A" with no salt and a
# salt "tenant-A" with no adapter both gave the extras ("tenant-A",).
#
# The encoding below is a concatenation of self-delimiting fields. Each field
# is either fixed width or preceded by its own length, and every variable
# choice (root or not, value type) is written as an explicit one-byte marker:
#
#   parent      b"\x00"                      (the root: no parent)
#               b"\x01" + u32 len + bytes    (the parent block's hash)
#   tokens      u32 count + count * u64      (each token id, big-endian)
#   extra keys  u32 count, then for each key:
#                 u32 len + tag (utf-8)
#                 type byte (b"s" str, b"b" bytes, b"i" int)
#                 u32 len + value bytes (str as utf-8, int as signed decimal)
#
# Why that is unambiguous: a reader starting at byte 0 always knows how many
# bytes the next field occupies (fixed width, or the length it just read), and
# what kind of field comes next (the format is fixed; markers choose between
# alternatives). So the reader recovers every field exactly, and the input is
# a function of the bytes: two inputs with equal encodings are equal. In
# particular ("salt", "tenant-A") and ("adapter", "tenant-A") differ in the tag
# field, and ("salt", "1") and ("salt", 1) differ in the type byte.

_U32 = struct.Struct(">I")
_VALUE_TYPES: dict[type, bytes] = {str: b"s", bytes: b"b", int: b"i"}


def _length_prefixed(data: bytes) -> bytes:
    return _U32.pack(len(data)) + data


def _encode_value(value: str | bytes | int) -> bytes:
    # type(...) rather than isinstance: bool is an int subclass, and True
    # would otherwise silently encode like 1.
    marker = _VALUE_TYPES.get(type(value))
    if marker is None:
        raise ValueError(f"extra_keys: values must be str, bytes or int, got {type(value).__name__}")
    if isinstance(value, str):
        raw = value.encode("utf-8")
    elif isinstance(value, int):
        raw = str(value).encode("ascii")
    else:
        raw = value
    return marker + _length_prefixed(raw)


def encode_block(
    parent_hash: BlockHash | None,
    token_ids: Sequence[int],
    extra_keys: Sequence[ExtraKey] | None = None,
) -> bytes:
    """The canonical bytes that identify one block (see the format above)."""
    parts: list[bytes] = []
    if parent_hash is None:
        parts.append(b"\x00")
    elif isinstance(parent_hash, bytes):
        parts.append(b"\x01" + _length_prefixed(parent_hash))
    else:
        raise ValueError(f"parent_hash: must be bytes or None, got {type(parent_hash).__name__}")

    try:
        parts.append(_U32.pack(len(token_ids)))
        parts.append(struct.pack(f">{len(token_ids)}Q", *token_ids))
    except struct.error:
        raise ValueError(
            f"token_ids: must be integers in [0, 2**64), got {list(token_ids)[:8]}{'...' if len(token_ids) > 8 else ''}"
        ) from None

    extra_keys = tuple(extra_keys or ())
    parts.append(_U32.pack(len(extra_keys)))
    for key in extra_keys:
        if not (isinstance(key, tuple) and len(key) == 2):
            raise ValueError(f"extra_keys: must be (source, value) pairs, got {key!r}")
        source, value = key
        if not (isinstance(source, str) and source.isidentifier()):
            raise ValueError(f"extra_keys: a source is a tag such as 'salt' (an identifier), got {source!r}")
        parts.append(_length_prefixed(source.encode("utf-8")))
        parts.append(_encode_value(value))
    return b"".join(parts)


def hash_block_tokens(
    parent_hash: BlockHash | None,
    token_ids: Sequence[int],
    extra_keys: Sequence[ExtraKey] | None = None,
    hash_fn: HashFn = sha256_hash,
) -> BlockHash:
    """H(parent hash, this block's token ids, extra keys).

    ``parent_hash`` is the previous block's hash, or None for the first block.
    Chaining makes a block's hash depend on every token before it, so the same
    four tokens after different prefixes get different hashes (their keys and
    values differ too: attention saw different context).

    ``extra_keys`` is a sequence of (source, value) pairs, for example
    ``(("salt", "tenant-A"),)``. Order matters: callers build the pairs in one
    fixed order (``KVCacheManager.block_extra_keys`` does).
    """
    return hash_fn(encode_block(parent_hash, token_ids, extra_keys))


def hash_request_tokens(
    block_size: int,
    token_ids: Sequence[int],
    extra_keys: Sequence[ExtraKey] | None = None,
    hash_fn: HashFn = sha256_hash,
) -> list[BlockHash]:
    """Chained hashes of every FULL block of ``token_ids``, from the root.

    A trailing partial block is never hashed: its contents will still change
    as tokens are appended, so it has no stable identity to share.
    """
    if type(block_size) is not int or block_size <= 0:
        raise ValueError(f"block_size: must be a positive integer, got {block_size!r}")
    hashes: list[BlockHash] = []
    parent: BlockHash | None = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block_tokens(parent, token_ids[start : start + block_size], extra_keys, hash_fn)
        hashes.append(parent)
    return hashes


# ---------------------------------------------------------------------------
# Blocks and the free queue
# ---------------------------------------------------------------------------


@dataclass
class KVCacheBlock:
    """Bookkeeping for one physical KV block (the tensors live elsewhere).

    - ``block_id``: the physical index into the KV tensors; never changes.
    - ``ref_cnt``: how many running requests have this block in their table.
      A block with ``ref_cnt == 0`` is in the free queue.
    - ``block_hash``: set once the block is full and registered in the prefix
      cache; cleared when the block is popped for reuse (its storage is about
      to be overwritten) or the prefix cache is reset.
    - ``prev_free_block`` / ``next_free_block``: links owned by
      ``FreeKVCacheBlockQueue``; both are None when the block is not in it.
    """

    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    prev_free_block: KVCacheBlock | None = field(default=None, repr=False, compare=False)
    next_free_block: KVCacheBlock | None = field(default=None, repr=False, compare=False)

    def __repr__(self) -> str:
        # Digests are long; the first 8 hex digits are enough to tell blocks apart.
        shown = "None" if self.block_hash is None else self.block_hash.hex()[:8] + "..."
        return f"KVCacheBlock(block_id={self.block_id}, ref_cnt={self.ref_cnt}, block_hash={shown})"


class FreeKVCacheBlockQueue:
    """Free blocks as a doubly linked list, head = next to be reused.

    A Python deque cannot remove from the middle in O(1), and a prefix-cache
    hit must do exactly that: a free-but-cached block that gets hit comes back
    into use from wherever it sits. So the links live on the blocks
    themselves, between two sentinel blocks (``block_id == -1``) that are
    never handed out; with sentinels, every real block in the list has both
    neighbours and no operation needs an "is this the end?" branch.

    The order is the eviction order: ``popleft`` takes the head. Policy
    (``BlockPool.free_blocks``) decides which end a freed block enters.
    """

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(block_id=-1)  # sentinel before the first
        self._tail = KVCacheBlock(block_id=-1)  # sentinel after the last
        self._head.next_free_block = self._tail
        self._tail.prev_free_block = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self.num_free_blocks

    def __iter__(self) -> Iterator[KVCacheBlock]:
        """Blocks from head (evicted first) to tail. Do not mutate while iterating."""
        block = self._head.next_free_block
        while block is not self._tail:
            assert block is not None
            yield block
            block = block.next_free_block

    def popleft(self) -> KVCacheBlock:
        """Remove and return the head block."""
        if self.num_free_blocks == 0:
            raise ValueError("free_block_queue: no free blocks to pop")
        block = self._head.next_free_block
        assert block is not None and block is not self._tail
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink ``block`` from anywhere in the queue, in O(1)."""
        prev, nxt = block.prev_free_block, block.next_free_block
        if prev is None or nxt is None:
            raise ValueError(f"block: block {block.block_id} is not in the free queue")
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        """Put ``block`` at the tail (reused last)."""
        last = self._tail.prev_free_block
        assert last is not None
        self._link_between(block, last, self._tail)

    def appendleft(self, block: KVCacheBlock) -> None:
        """Put ``block`` at the head (reused first)."""
        first = self._head.next_free_block
        assert first is not None
        self._link_between(block, self._head, first)

    def _link_between(self, block: KVCacheBlock, prev: KVCacheBlock, nxt: KVCacheBlock) -> None:
        if block.prev_free_block is not None or block.next_free_block is not None:
            raise ValueError(f"block: block {block.block_id} is already in the free queue")
        block.prev_free_block, block.next_free_block = prev, nxt
        prev.next_free_block = block
        nxt.prev_free_block = block
        self.num_free_blocks += 1
