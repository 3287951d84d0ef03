"""A fused drop-in for pytorch-metric-learning's ``losses.CircleLoss``.

Replace ``from pytorch_metric_learning.losses import CircleLoss`` with
``from circle_loss.pml import CircleLoss``: same constructor (``m=0.4,
gamma=80``, ``reducer``, ``distance``, ``embedding_regularizer``, ...), same
results, and the same class name, so ``CrossBatchMemory`` and
``SelfSupervisedLoss`` accept it. Needs the optional dependency
``pytorch-metric-learning`` (the extra ``pml``).

With labels and no ``indices_tuple`` the per-anchor losses come from
``torch.ops.circle.anchor_loss``, which never forms the B×M similarity
matrix; the result is PML's per-element loss dict, so its reducers,
regularizers, hooks and stats work unchanged. Everything else (a miner's
``indices_tuple``, ``CrossBatchMemory``'s removal of self comparisons, a
distance other than cosine or dot-product similarity, ``ref_emb`` given with
``ref_labels is labels``) goes through PML's own code.
"""

from __future__ import annotations

from pytorch_metric_learning import losses as _pml_losses
from pytorch_metric_learning.distances import CosineSimilarity, DotProductSimilarity
from pytorch_metric_learning.utils import common_functions as c_f

from . import anchor_loss  # importing the package registers the ops


class CircleLoss(_pml_losses.CircleLoss):
    """pytorch-metric-learning's ``CircleLoss``, computed by the fused op."""

    def compute_loss(self, embeddings, labels, indices_tuple, ref_emb, ref_labels):
        if not self._fused(embeddings, labels, indices_tuple, ref_emb, ref_labels):
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
        )
        return {
            "loss": {
                "losses": per_anchor.unsqueeze(1),  # PML's shape: (B, 1)
                "indices": c_f.torch_arange_from_size(embeddings),
                "reduction_type": "element",
            }
        }

    def _fused(self, embeddings, labels, indices_tuple, ref_emb, ref_labels) -> bool:
        """Whether the op computes exactly what PML's code would."""
        if indices_tuple is not None or labels is None:
            return False
        if type(self.distance) not in (CosineSimilarity, DotProductSimilarity) or self.distance.power != 1:
            return False
        if ref_labels is labels and ref_emb is not embeddings:
            return False  # PML's diagonal removal between two different sets
        # PML returns an already-reduced zero when there are at most one
        # positive and one negative pair: at most two pairs in all.
        pairs = embeddings.shape[0] * ref_emb.shape[0] - (embeddings.shape[0] if ref_labels is labels else 0)
        return pairs > 2


__all__ = ["CircleLoss"]
