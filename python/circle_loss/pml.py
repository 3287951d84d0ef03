"""Fused drop-ins for pytorch-metric-learning's ``losses.CircleLoss`` and
``losses.CrossBatchMemory``.

Replace ``from pytorch_metric_learning.losses import CircleLoss`` with
``from circle_loss.pml import CircleLoss``: same constructor (``m=0.4,
gamma=80``, ``reducer``, ``distance``, ``embedding_regularizer``, ...), same
results, and the same class name, so PML's ``CrossBatchMemory`` and
``SelfSupervisedLoss`` accept it. Needs the optional dependency
``pytorch-metric-learning`` (the extra ``pml``).

With labels and no ``indices_tuple`` the per-anchor losses come from
``torch.ops.circle.anchor_loss``, which never forms the B×M similarity
matrix; the result is PML's per-element loss dict, so its reducers,
regularizers, hooks and stats work unchanged. Everything else (a miner's
``indices_tuple``, a distance other than cosine or dot-product similarity,
``ref_emb`` given with ``ref_labels is labels``) goes through PML's own code.

PML's ``CrossBatchMemory`` hands its loss an ``indices_tuple`` (every pair of
the batch with the bank but each query's own copy), which the op cannot
read back without forming it. ``circle_loss.pml.CrossBatchMemory``, the same
class with the same constructor, passes the bank to the loss as it is
instead: with this module's ``CircleLoss``, no miner and no
``indices_tuple``, each batch against the bank is one call of the op, its
queries' own copies left out by position (``ref_self_index``).
"""

from __future__ import annotations

from pytorch_metric_learning import losses as _pml_losses
from pytorch_metric_learning.distances import CosineSimilarity, DotProductSimilarity
from pytorch_metric_learning.utils import common_functions as c_f
from pytorch_metric_learning.utils import loss_and_miner_utils as lmu

from . import anchor_loss  # importing the package registers the ops


class _BankPairs:
    """What CrossBatchMemory passes its loss in place of an indices_tuple:
    every pair of the batch with the bank, but each query with its own copy
    at bank row ``copies[i]`` (``copies`` None: every pair)."""

    def __init__(self, copies, bank_size):
        self.copies = copies
        self.bank_size = bank_size

    def indices_tuple(self, labels, ref_labels):
        """PML's own indices_tuple for these pairs."""
        pairs = lmu.get_all_pairs_indices(labels, ref_labels)
        return pairs if self.copies is None else lmu.remove_self_comparisons(pairs, self.copies, self.bank_size)


class CircleLoss(_pml_losses.CircleLoss):
    """pytorch-metric-learning's ``CircleLoss``, computed by the fused op."""

    def compute_loss(self, embeddings, labels, indices_tuple, ref_emb, ref_labels):
        bank = indices_tuple if isinstance(indices_tuple, _BankPairs) else None
        if bank is not None:
            indices_tuple = None
        if not self._fused(embeddings, labels, indices_tuple, ref_emb, ref_labels, bank):
            if bank is not None:
                indices_tuple = bank.indices_tuple(labels, ref_labels)
            return super().compute_loss(embeddings, labels, indices_tuple, ref_emb, ref_labels)
        # PML leaves out the pairs (i, i) exactly when ref_labels is labels
        # (its default, with ref_emb the embeddings themselves).
        self_pairs = ref_labels is labels
        query = self.distance.maybe_normalize(embeddings)
        ref = query if self_pairs else self.distance.maybe_normalize(ref_emb)
        self.distance.set_default_stats(embeddings, ref_emb, query, ref)
        per_anchor = anchor_loss(
            query,
            labels,
            None if self_pairs else ref,
            None if self_pairs else ref_labels,
            float(self.m),
            float(self.gamma),
            None if bank is None else bank.copies,
        )
        return {
            "loss": {
                "losses": per_anchor.unsqueeze(1),  # PML's shape: (B, 1)
                "indices": c_f.torch_arange_from_size(embeddings),
                "reduction_type": "element",
            }
        }

    def _fused(self, embeddings, labels, indices_tuple, ref_emb, ref_labels, bank=None) -> bool:
        """Whether the op computes exactly what PML's code would."""
        if indices_tuple is not None or labels is None:
            return False
        if type(self.distance) not in (CosineSimilarity, DotProductSimilarity) or self.distance.power != 1:
            return False
        if ref_labels is labels and ref_emb is not embeddings:
            return False  # PML's diagonal removal between two different sets
        # PML returns an already-reduced zero when there are at most one
        # positive and one negative pair: at most two pairs in all. A pair
        # is left out per row without a reference set, and per query's copy
        # in a bank.
        left_out = ref_labels is labels or (bank is not None and bank.copies is not None)
        pairs = embeddings.shape[0] * ref_emb.shape[0] - (embeddings.shape[0] if left_out else 0)
        return pairs > 2


class CrossBatchMemory(_pml_losses.CrossBatchMemory):
    """pytorch-metric-learning's ``CrossBatchMemory`` (same constructor, same
    results), which lets this module's ``CircleLoss`` compute each batch
    against the bank in one call of the op."""

    def create_indices_tuple(self, embeddings, labels, E_mem, L_mem, input_indices_tuple, do_remove_self_comparisons):
        if self.miner is not None or input_indices_tuple is not None or not isinstance(self.loss, CircleLoss):
            return super().create_indices_tuple(
                embeddings, labels, E_mem, L_mem, input_indices_tuple, do_remove_self_comparisons
            )
        # curr_batch_idx: the bank rows that add_to_memory has just filled
        # with this batch, in its order; PML removes exactly those pairs,
        # except for a batch of one query, whose first and last rows coincide
        # and which its removal takes for a batch that wraps round the bank:
        # it keeps that pair, and so does this, to give PML's results.
        copies = self.curr_batch_idx if do_remove_self_comparisons and len(self.curr_batch_idx) > 1 else None
        return _BankPairs(copies, self.memory_size)


__all__ = ["CircleLoss", "CrossBatchMemory"]
