"""Host-side bookkeeping of the paged KV cache: which pool blocks each slot reads, and who owns them.

The pool of each sampler replica is `num_blocks` blocks of `block_size` positions (per layer, on the
device: `models.paged_cache`). A slot's block table lists the blocks holding its positions in order;
the G samples of a group list the same blocks for their shared prompt (reference counted), each its
own block from the prompt's last, partly filled one on (copied, since each writes its own tokens
there). A block goes back to the free list the moment its last reference is dropped. A slot's blocks
can also be parked (a multi-turn episode waiting on its environment keeps its conversation's KV
without holding a slot): a parked entry is a cache, dropped first when the pool runs dry.
"""

from __future__ import annotations

import dataclasses


class OutOfBlocks(RuntimeError):
  """The pool has fewer free blocks than asked for (the engine preempts or defers admission)."""


class BlockAllocator:
  """Reference-counted blocks [0, num_blocks) of one pool."""

  def __init__(self, num_blocks: int):
    if num_blocks <= 0:
      raise ValueError(f"BlockAllocator: num_blocks={num_blocks} must be > 0")
    self.num_blocks = num_blocks
    self._refs = [0] * num_blocks
    self._free = list(range(num_blocks - 1, -1, -1))  # a stack: the lowest ids go first

  @property
  def num_free(self) -> int:
    return len(self._free)

  def refs(self, block: int) -> int:
    return self._refs[block]

  def allocate(self, n: int) -> list[int]:
    """n fresh blocks, each with one reference; raises OutOfBlocks (taking none) if fewer are free."""
    if n > len(self._free):
      raise OutOfBlocks(f"{n} blocks asked, {len(self._free)} free of {self.num_blocks}")
    out = [self._free.pop() for _ in range(n)]
    for b in out:
      self._refs[b] = 1
    return out

  def share(self, blocks) -> None:
    """One more reference to each of `blocks` (another slot reads them)."""
    for b in blocks:
      if self._refs[b] <= 0:
        raise ValueError(f"share: block {b} is free")
      self._refs[b] += 1

  def compact(self) -> list[tuple[int, int]]:
    """Moves the blocks in use to the lowest ids (each keeps its references): returns the moves
    (src, dst), highest src to lowest free dst, for the caller to copy the KV and rename."""
    used = self.num_blocks - len(self._free)
    sources = [b for b in range(used, self.num_blocks) if self._refs[b] > 0]
    holes = [b for b in range(used) if self._refs[b] == 0]
    for src, dst in zip(sources, holes):
      self._refs[dst], self._refs[src] = self._refs[src], 0
    self._free = list(range(self.num_blocks - 1, used - 1, -1))  # a stack: the lowest ids go first
    return list(zip(sources, holes))

  def highest_in_use(self) -> int:
    """The highest block id with a reference (-1 if none)."""
    return next((b for b in range(self.num_blocks - 1, -1, -1) if self._refs[b] > 0), -1)

  def release(self, blocks) -> None:
    """Drops one reference to each of `blocks`; a block nobody references is free at once."""
    for b in blocks:
      if self._refs[b] <= 0:
        raise ValueError(f"release: block {b} is already free")
      self._refs[b] -= 1
      if self._refs[b] == 0:
        self._free.append(b)


@dataclasses.dataclass
class SlotBlocks:
  """One slot's block table and when its sequence started (the youngest is preempted first)."""

  blocks: list[int] = dataclasses.field(default_factory=list)
  started: int = -1  # admission order; -1: the slot is empty


def blocks_for(num_positions: int, block_size: int) -> int:
  """Blocks that hold positions [0, num_positions)."""
  return -(-num_positions // block_size)


class BlockTables:
  """Every slot's blocks, over one allocator per sampler replica (slot s is on replica s // per_replica)."""

  def __init__(self, num_slots: int, replicas: int, blocks_per_replica: int, block_size: int):
    self.block_size = block_size
    self.per_replica = num_slots // replicas
    self.pools = [BlockAllocator(blocks_per_replica) for _ in range(replicas)]
    self.slots = [SlotBlocks() for _ in range(num_slots)]
    self.parked: dict[int, tuple[int, list[int]]] = {}  # key -> (replica, blocks), oldest first
    self._admitted = 0
    self._next_park = 0

  def pool_of(self, slot: int) -> BlockAllocator:
    return self.pools[slot // self.per_replica]

  def start(self, slot: int, shared: list[int], own: list[int]) -> None:
    """Slot `slot` begins a sequence reading `shared` (one more reference each) then `own` blocks."""
    if self.slots[slot].started >= 0:
      raise ValueError(f"start: slot {slot} still holds a sequence")
    self.pool_of(slot).share(shared)
    self.slots[slot] = SlotBlocks(blocks=list(shared) + list(own), started=self._admitted)
    self._admitted += 1

  def grow(self, slot: int, num_positions: int) -> None:
    """Allocates blocks so that `slot` holds positions [0, num_positions); OutOfBlocks if short."""
    entry = self.slots[slot]
    need = blocks_for(num_positions, self.block_size) - len(entry.blocks)
    if need > 0:
      entry.blocks += self.pool_of(slot).allocate(need)

  def free(self, slot: int) -> None:
    """The slot's sequence ended (or was preempted): its references are dropped."""
    entry = self.slots[slot]
    if entry.started >= 0:
      self.pool_of(slot).release(entry.blocks)
      self.slots[slot] = SlotBlocks()

  def park(self, slot: int, num_positions: int) -> int:
    """Moves the slot's blocks holding positions [0, num_positions) to a parked entry (the rest are
    released) and empties the slot. Returns the entry's key."""
    entry = self.slots[slot]
    if entry.started < 0:
      raise ValueError(f"park: slot {slot} holds no sequence")
    keep = blocks_for(num_positions, self.block_size)
    pool = self.pool_of(slot)
    pool.release(entry.blocks[keep:])
    key, self._next_park = self._next_park, self._next_park + 1
    self.parked[key] = (slot // self.per_replica, entry.blocks[:keep])
    self.slots[slot] = SlotBlocks()
    return key

  def unpark(self, key: int) -> tuple[int, list[int]] | None:
    """Takes a parked entry out (None if it was dropped): its references pass to the caller."""
    return self.parked.pop(key, None)

  def drop_parked(self, key: int | None = None, replica: int | None = None) -> bool:
    """Releases parked entry `key`, or the oldest on `replica`; False if there was none."""
    if key is None:
      key = next((k for k, (r, _) in self.parked.items() if r == replica), None)
    found = self.unpark(key) if key is not None else None
    if found is not None:
      self.pools[found[0]].release(found[1])
    return found is not None

  def compact(self, replica: int) -> list[tuple[int, int]]:
    """Packs the replica's blocks in use into its lowest ids (`BlockAllocator.compact`) and renames
    them in every slot's table and parked entry; returns the moves (src, dst)."""
    moves = self.pools[replica].compact()
    rename = dict(moves)
    if rename:
      lo = replica * self.per_replica
      for entry in self.slots[lo:lo + self.per_replica]:
        entry.blocks = [rename.get(b, b) for b in entry.blocks]
      for key, (r, blocks) in self.parked.items():
        if r == replica:
          self.parked[key] = (r, [rename.get(b, b) for b in blocks])
    return moves

  def youngest(self, replica: int, exclude=()) -> int | None:
    """The live slot of `replica` admitted last (None if none is live)."""
    lo = replica * self.per_replica
    live = [s for s in range(lo, lo + self.per_replica) if self.slots[s].started >= 0 and s not in exclude]
    return max(live, key=lambda s: self.slots[s].started, default=None)

  def blocks_in_use(self) -> int:
    return sum(self.blocks_in_use_of(r) for r in range(len(self.pools)))

  def blocks_in_use_of(self, replica: int) -> int:
    pool = self.pools[replica]
    return pool.num_blocks - pool.num_free
