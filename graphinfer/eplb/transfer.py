"""Which expert weights move where when a placement changes (pure host code; runtime/worker/eplb_state.py runs the
copies). A placement row lists the logical expert of each physical slot; EP rank r holds slots [r*S, (r+1)*S)."""
from collections import Counter
from dataclasses import dataclass


@dataclass(frozen=True)
class Move:
    """Local slot dst_slot of rank dst_rank gets the weights of local slot src_slot of rank src_rank (as they were
    before the change); src_rank == dst_rank is a copy within the rank."""
    dst_rank: int
    dst_slot: int
    src_rank: int
    src_slot: int


def plan_moves(old: list[int], new: list[int], ep_size: int) -> list[Move]:
    """The copies that turn placement row `old` into `new`, in (dst_rank, dst_slot) order (every rank posts its sends
    and receives in this order, so point-to-point messages pair up). A slot whose expert is unchanged moves nothing;
    one whose new expert its rank already held copies it locally; otherwise a rank that held it sends it (of several,
    the (dst_rank mod holders)-th, so the senders share the work)."""
    if len(old) != len(new) or len(old) % ep_size:
        raise ValueError(f"placements of {len(old)} and {len(new)} slots over {ep_size} ranks")
    per = len(old) // ep_size
    holders: dict[int, list[tuple[int, int]]] = {}
    for p, e in enumerate(old):
        holders.setdefault(e, []).append((p // per, p % per))
    moves = []
    for p, e in enumerate(new):
        if old[p] == e:
            continue
        rank = p // per
        if e not in holders:
            raise ValueError(f"expert {e} of the new placement has no replica in the old one")
        here = [h for h in holders[e] if h[0] == rank]
        src = here[0] if here else holders[e][rank % len(holders[e])]
        moves.append(Move(rank, p % per, *src))
    return moves


def keep_in_place(old: list[int], new: list[int], ep_size: int) -> list[int]:
    """`new` with each rank's slots reordered (the experts a rank holds, not their order, decide the balance) so that
    an expert the rank already held stays in its old slot: fewer copies within ranks. Deterministic: the rest fill
    the freed slots in `new`'s order."""
    per = len(old) // ep_size
    out = []
    for r in range(ep_size):
        ranks_new = new[r * per:(r + 1) * per]
        wanted = Counter(ranks_new)
        row = []
        for e in old[r * per:(r + 1) * per]:  # an expert still wanted here keeps its slot
            row.append(e if wanted[e] > 0 else None)
            if wanted[e] > 0:
                wanted[e] -= 1
        rest = []
        for e in ranks_new:  # the experts new to the rank (or extra replicas), in new's order
            if wanted[e] > 0:
                rest.append(e)
                wanted[e] -= 1
        rest.reverse()
        out += [e if e is not None else rest.pop() for e in row]
    return out
