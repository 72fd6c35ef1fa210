"""Every rank of a layer's tensor-and-context-parallel group refuses a call together, or none does.

A call's checks read this rank's data: its rows of Megatron's attention mask, the documents
of a ``reset_attention_mask`` mask, its packed boundaries.  Context-parallel ranks hold
different rows of one sequence, so one rank can refuse what another accepts; the accepting
rank would then enter the call's all-to-all alone and wait there until the process group
times out (over gloo it dies with a raw ``RuntimeError`` once its peer is gone).  Tensor-
parallel ranks are given the same batch by Megatron, but a data loader of one's own need not.

So a call that carries such data (an ``attention_mask`` or ``packed_seq_params``) runs its
checks inside `RankAgreement.checks`, and then every rank of the group exchanges one small
integer vector (one all-reduce): entry ``r`` is 0 where rank ``r`` accepts, else the index of
its refusal's rule.  Where any entry is not 0, every rank raises: a refusing rank its own
error, the others `refusals.RANK_REFUSED` naming the first refusing rank and its rule, all with
the rank in the error's context.  A call without such data decides from shapes, dtypes and the plan
alone, which Megatron makes equal on every rank of the group, so it exchanges nothing.

The value checks run as on-device assertions (`backends.check_op.assert_on_device`).  While
the checks are collected they are recorded instead (`check_op.DEFERRED`), and asserted only
after the exchange: on a GPU a device-side assert on one rank would otherwise stop it before
the all-reduce, leaving the others in it.  No host sync is added there: the agreed vector is
asserted on the device too.  On CPU, eagerly, the vector is read and the errors are ours.
Under ``torch.compile`` the same exchange is traced (a functional all-reduce) and every verdict is
a check op of the graph (`check_op.refuse_unless`), placed after the all-reduce and before the
kernel: a refusing rank raises its own error when the graph runs, the others `RANK_REFUSED` (which
names the refusing rank; its rule only eagerly, where it is read).  Nothing of the call is computed before the agreement: the checks are all a call makes before
its kernel (`primus_ext.megatron.core`), and the kernel runs only after it.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import Tensor

from .. import refusals as R
from ..backends import check_op
from ..errors import PrimusExtError, UnsupportedInputError

_CODES = {code: i + 1 for i, code in enumerate(R.CALL_RULES)}  # declaration order: the same on every rank
_NAMES = {i: code for code, i in _CODES.items()}


def agreement_group(pg_collection: Any) -> Any:
    """The layer's tensor-and-context-parallel group: ``pg_collection.tp_cp``, else megatron-core's (or None)."""
    group = getattr(pg_collection, "tp_cp", None) if pg_collection is not None else None
    if group is not None:
        return group
    from megatron.core import parallel_state

    return parallel_state.get_tensor_and_context_parallel_group(check_initialized=False)


def _rule_index(exc: PrimusExtError) -> int:
    codes = getattr(exc, "codes", ())
    return _CODES.get(codes[0], len(_CODES) + 1) if codes else len(_CODES) + 1


class _Checks:
    """The checks of one call on this rank: its first refusal raised on the host, and its on-device ones."""

    def __init__(self) -> None:
        self.refused: Optional[UnsupportedInputError] = None
        self.device: list[tuple[Tensor, str, Callable[[], PrimusExtError]]] = []


class RankAgreement:
    """One layer's agreement over its group (``size`` 1: nothing is ever exchanged)."""

    def __init__(self, group: Any) -> None:
        ok = group is not None and isinstance(group, dist.ProcessGroup) and dist.is_initialized()
        self.group = group if ok else None
        self.size = dist.get_world_size(group) if ok else 1
        self.rank = dist.get_rank(group) if ok else 0
        self.context = f"Megatron core attention, rank {self.rank} of {self.size} in its tensor-and-context-" \
                       "parallel group"

    def needed(self, attention_mask: Any, packed_seq_params: Any) -> bool:
        """Whether a call decides from this rank's data (the same answer on every rank: Megatron gives every
        rank of the group a mask, or packed params, or neither)."""
        return self.size > 1 and (attention_mask is not None or packed_seq_params is not None)

    def run(self, needed: bool, checks: Callable[[], Any]) -> Any:
        """``checks()``'s result once every rank has accepted its own call; raises on every rank otherwise."""
        if not needed:
            return checks()
        found = _Checks()
        check_op.DEFERRED.append(found.device)
        try:
            result = checks()
        except UnsupportedInputError as exc:
            if torch.compiler.is_compiling():  # refused while traced: shapes only, alike on every rank
                raise
            found.refused, result = exc, None
        finally:
            check_op.DEFERRED.pop()
        self._settle(found)
        return result

    def _settle(self, found: _Checks) -> None:
        device = found.device[0][0].device if found.device else torch.device("cpu")
        mine = torch.tensor(_rule_index(found.refused) if found.refused is not None else 0, device=device)
        for ok, _, refusal in reversed(found.device):  # the first failing check's rule
            mine = torch.where(ok, mine, torch.full_like(mine, _rule_index_of(refusal)))
        vector = torch.zeros(self.size, dtype=torch.int64, device=device).index_put((torch.tensor(
            [self.rank], device=device),), mine.to(torch.int64))
        agreed = funcol.wait_tensor(funcol.all_reduce(vector, "sum", self.group))
        if device.type == "cpu" and not torch.compiler.is_compiling():
            self._raise(found, agreed.tolist())
            return
        for ok, why, refusal in found.device:  # this rank's own checks, then every other rank's verdict
            check_op.assert_on_device(ok, why, refusal)
        for rank in range(self.size):
            if rank != self.rank:
                check_op.assert_on_device(agreed[rank] == 0, f"primus_ext: rank {rank} of this layer's tensor-and-"
                                          "context-parallel group refused this call",
                                          lambda r=rank, c=self.context: R.refuse(
                                              R.RANK_REFUSED, c, rank=r, code="its error names the rule"))

    def _raise(self, found: _Checks, agreed: list[int]) -> None:
        refusing = next((rank for rank, code in enumerate(agreed) if code), None)
        if refusing is None:
            return
        if agreed[self.rank]:  # this rank refused too: its own error
            own = found.refused
            if own is None:
                own = next(refusal() for ok, _, refusal in found.device if not bool(ok))
            raise R.refuse_all(own.reasons, context=self.context, at_call=True) from None
        code = _NAMES.get(agreed[refusing], "a refusal of its own")
        raise R.refuse(R.RANK_REFUSED, self.context, rank=refusing, code=code)


def _rule_index_of(refusal: Callable[[], PrimusExtError]) -> int:
    """The rule index of a recorded check (its refusal is built to read the code; nothing is raised)."""
    if torch.compiler.is_compiling():
        return len(_CODES) + 1  # the refusal is a graph constant there: the rank's own error names it
    return _rule_index(refusal())


__all__ = ["RankAgreement", "agreement_group"]
