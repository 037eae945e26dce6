"""GRPO's ``top_k_kl`` records: the K tokens of highest k3 over all ranks, numbered in the global batch.

Each rank keeps its running top K on the device (:class:`HighKLRecords`: one
``[K, fields]`` float64 tensor, merged per microbatch without a host sync) and
the number of sequences of each ``accumulate`` call; at ``calculate()`` both
become picklable records (the sync's one extra gather), and
:func:`global_top_kl` numbers every sequence in the global batch (the calls in
order, the DP ranks in order within a call) and keeps the global top K.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import torch

RECORD_FIELDS = ("kl", "ratio", "logp_new", "logp_old", "token_id", "sequence", "position", "call")
# A saved record's key of each field (the call is not saved: a checkpoint is one earlier call).
SAVED_FIELDS = {"kl": "kl", "ratio": "ratio", "logp_new": "logp_new", "logp_old": "logp_old", "token_id": "token_id",
                "sequence": "gsi", "position": "pos"}


class HighKLRecords:
    """One rank's running top-K tokens of highest k3 and the sequences of each call (see the module docstring)."""

    def __init__(self, top_k: int) -> None:
        self.top_k = top_k
        self.tokens: Optional[torch.Tensor] = None  # [≤K, len(RECORD_FIELDS)] float64, on the device
        self.sequences_per_call: list[int] = []

    def keep(self, kl: torch.Tensor, ratio: torch.Tensor, new: torch.Tensor, old: torch.Tensor, labels: torch.Tensor,
             counted: torch.Tensor, first_sequence: int, positions: torch.Tensor) -> None:
        """Merge a microbatch's highest-k3 ``counted`` tokens (``[sequences, length]`` tensors; ``positions``: each
        column's position in the whole sequence) into the running top K; device ops only."""
        sequence_length = kl.shape[-1]
        candidates = torch.where(counted, kl, torch.full_like(kl, float("-inf"))).reshape(-1)
        k = min(self.top_k, candidates.numel())
        if k == 0:
            return
        top, index = candidates.topk(k)
        rows, columns = index // sequence_length, index % sequence_length
        fields = torch.stack([
            top, ratio.reshape(-1)[index], new.reshape(-1)[index], old.reshape(-1)[index],
            labels.reshape(-1)[index].to(torch.float64), (rows + first_sequence).to(torch.float64),
            positions[columns].to(torch.float64),
            torch.full_like(top, float(len(self.sequences_per_call))),
        ], dim=1)
        merged = fields if self.tokens is None else torch.cat([self.tokens, fields.to(self.tokens.device)])
        keep = merged[:, 0].topk(min(self.top_k, merged.shape[0])).indices
        self.tokens = merged[keep]

    def end_call(self, sequences: int) -> None:
        """Close an ``accumulate`` call that held ``sequences`` sequences on this rank."""
        self.sequences_per_call.append(sequences)

    def records(self, dp_rank: int) -> list:
        """This rank's picklable records: one per call (its sequences), one per kept token. Reads the device
        tensor: for ``calculate()`` time only (a host sync)."""
        records: list = [("sequences", call, dp_rank, count) for call, count in enumerate(self.sequences_per_call)]
        if self.tokens is not None:
            rows = self.tokens[self.tokens[:, 0] > 0].tolist()
            records += [("token", dp_rank, dict(zip(RECORD_FIELDS, row))) for row in rows]
        return records

    def reset(self) -> None:
        self.tokens, self.sequences_per_call = None, []

    def load(self, state: Mapping[str, Any], holder: bool, device: torch.device) -> None:
        r"""Continue from :func:`saved_state`: the saved top K and sequence count become one earlier call of
        the rank that ``holder``\ s the loaded sums (nothing elsewhere), so new sequences are numbered after them."""
        self.reset()
        self.sequences_per_call = [int(state["sequences"]) if holder else 0]
        saved = state["top_kl"] if holder else []
        if saved:
            rows = [[float(record[SAVED_FIELDS[name]]) if name in SAVED_FIELDS else 0.0 for name in RECORD_FIELDS]
                    for record in saved]
            self.tokens = torch.tensor(rows, dtype=torch.float64, device=device)


def saved_state(records: list, top_k: int) -> dict[str, Any]:
    """The checkpoint entries of all ranks' ``records``: the global top K so far and the sequences seen."""
    sequences = sum({(r[1], r[2]): r[3] for r in records if r[0] == "sequences"}.values())
    return {"top_kl": global_top_kl(records, top_k), "sequences": sequences}


def global_top_kl(records: list, top_k: int) -> list[dict[str, Any]]:
    """The top-K of all ranks' ``records``, with sequence indices in the global batch."""
    counts: dict[tuple[int, int], int] = {}
    tokens = []
    for record in records:
        if record[0] == "sequences":
            _, call, dp_rank, count = record
            counts[(call, dp_rank)] = max(count, counts.get((call, dp_rank), 0))  # CP ranks agree
        else:
            tokens.append(record[1:])
    offsets, running = {}, 0
    for call, dp_rank in sorted(counts):
        offsets[(call, dp_rank)] = running
        running += counts[(call, dp_rank)]
    results = [{
        "gsi": offsets.get((int(fields["call"]), dp_rank), 0) + int(fields["sequence"]),
        "pos": int(fields["position"]),
        "token_id": int(fields["token_id"]),
        "kl": fields["kl"],
        "ratio": fields["ratio"],
        "logp_new": fields["logp_new"],
        "logp_old": fields["logp_old"],
    } for dp_rank, fields in tokens]
    results.sort(key=lambda r: (-r["kl"], r["gsi"], r["pos"]))
    return results[:top_k]
