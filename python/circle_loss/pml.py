"""Fused drop-ins for pytorch-metric-learning's ``losses.CircleLoss``,
``losses.CrossBatchMemory`` and ``utils.distributed.DistributedLossWrapper``,
and ``ClassCircleLoss``, the class-level Circle Loss as a PML classification
loss.

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
complex labels, ``ref_emb`` of another length than the batch's given without
its own labels) goes through PML's own code.

PML's ``CrossBatchMemory`` hands its loss an ``indices_tuple`` (every pair of
the batch with the bank but each query's own copy), which the op cannot
read back without forming it. ``circle_loss.pml.CrossBatchMemory``, the same
class with the same constructor, passes the bank to the loss as it is
instead: with this module's ``CircleLoss``, no miner and no
``indices_tuple``, each batch against the bank is one call of the op, its
queries' own copies left out by position (``ref_self_index``).
"""

from __future__ import annotations

import torch
from pytorch_metric_learning import losses as _pml_losses
from pytorch_metric_learning.distances import CosineSimilarity, DotProductSimilarity
from pytorch_metric_learning.losses.base_metric_loss_function import BaseMetricLossFunction
from pytorch_metric_learning.losses.mixins import WeightRegularizerMixin
from pytorch_metric_learning.utils import common_functions as c_f
from pytorch_metric_learning.utils import distributed as _pml_distributed
from pytorch_metric_learning.utils import loss_and_miner_utils as lmu

from . import (  # registers the ops
    CLASS_DEFAULT_GAMMA,
    CLASS_DEFAULT_MARGIN,
    _check_labels_in_range,
    _check_sample_rate,
    _sampled_classes,
    anchor_loss,
    class_loss,
)


class _BankPairs:
    """What CrossBatchMemory (and DistributedLossWrapper) pass the loss in
    place of an indices_tuple: every pair of the batch with the bank (the
    gathered batch), but each query with its own copy at row ``copies[i]``
    (``copies`` None: every pair)."""

    def __init__(self, copies, bank_size):
        self.copies = copies
        self.bank_size = bank_size

    def indices_tuple(self, labels, ref_labels):
        """PML's own indices_tuple for these pairs."""
        pairs = lmu.get_all_pairs_indices(labels, ref_labels)
        return pairs if self.copies is None else lmu.remove_self_comparisons(pairs, self.copies, self.bank_size)


# float64 quiet-NaN bit patterns: no number's bits equal them, so NaN labels
# (which PML's == matches with nothing, not even themselves) take distinct ids
# from here on, one a position.
_NAN_IDS = 0x7FF8_0000_0000_0001


def _class_ids(labels, ref_labels):
    """``labels`` and ``ref_labels`` (or None) as integer class ids that are
    equal exactly where PML's ``labels[i] == ref_labels[j]`` holds, after the
    same type promotion; None for labels the op cannot take (complex)."""
    common = labels.dtype if ref_labels is None else torch.promote_types(labels.dtype, ref_labels.dtype)
    if common.is_complex:
        return None
    if not common.is_floating_point:
        if common == torch.bool:
            common = torch.uint8
        return labels.to(common), None if ref_labels is None else ref_labels.to(common)
    # Promoted as PML's comparison promotes them, then widened exactly to
    # float64, whose bits are equal where the values are (+ 0.0 makes -0.0
    # into 0.0), NaNs apart.
    offset = 0
    ids = []
    for values in (labels, ref_labels):
        if values is None:
            ids.append(None)
            continue
        wide = values.to(common).to(torch.float64) + 0.0
        bits = wide.view(torch.int64)
        positions = torch.arange(offset, offset + len(values), device=values.device)
        ids.append(torch.where(torch.isnan(wide), _NAN_IDS + positions, bits))
        offset += len(values)
    return ids[0], ids[1]


class CircleLoss(_pml_losses.CircleLoss):
    """pytorch-metric-learning's ``CircleLoss``, computed by the fused op.

    Same constructor (``m=0.4, gamma=80``, ``reducer``, ``distance``,
    ``embedding_regularizer``, ...) and same ``forward(embeddings, labels,
    indices_tuple=None, ref_emb=None, ref_labels=None)`` as PML's class, with
    the same results and errors; labels of any dtype PML compares (integer,
    bool, floating: 0.5 and 0.7 are two classes)."""

    def compute_loss(self, embeddings, labels, indices_tuple, ref_emb, ref_labels):
        bank = indices_tuple if isinstance(indices_tuple, _BankPairs) else None
        if bank is not None:
            indices_tuple = None
        call = self._fused_call(embeddings, labels, indices_tuple, ref_emb, ref_labels, bank)
        if call is None:
            if bank is not None:
                indices_tuple = bank.indices_tuple(labels, ref_labels)
            return super().compute_loss(embeddings, labels, indices_tuple, ref_emb, ref_labels)
        query = self.distance.maybe_normalize(embeddings)
        ref = query if ref_emb is embeddings else self.distance.maybe_normalize(ref_emb)
        self.distance.set_default_stats(embeddings, ref_emb, query, ref)
        ids, ref_ids, left_out = call
        per_anchor = anchor_loss(
            query,
            ids,
            None if ref_ids is None else ref,
            ref_ids,
            float(self.m),
            float(self.gamma),
            left_out,
        )
        return {
            "loss": {
                "losses": per_anchor.unsqueeze(1),  # PML's shape: (B, 1)
                "indices": c_f.torch_arange_from_size(embeddings),
                "reduction_type": "element",
            }
        }

    def _fused_call(self, embeddings, labels, indices_tuple, ref_emb, ref_labels, bank=None):
        """The op's (labels, ref_labels, ref_self_index) that compute exactly
        what PML's code would, or None where only PML's code does."""
        if indices_tuple is not None or labels is None:
            return None
        if type(self.distance) not in (CosineSimilarity, DotProductSimilarity) or self.distance.power != 1:
            return None
        # PML compares labels with themselves, leaving out the pairs (i, i),
        # where ref_labels is labels (its default) or was not given; then
        # against ref_emb's first B rows, which the op takes when there are
        # B (with other counts PML's code gives its own result or error).
        labels_twice = ref_labels is None or ref_labels is labels
        self_pairs = labels_twice and ref_emb is embeddings
        if labels_twice and not self_pairs and ref_emb.shape[0] != embeddings.shape[0]:
            if 1 < embeddings.shape[0] and ref_emb.shape[0] < embeddings.shape[0]:
                # PML's pairs then name every row of labels as a column of
                # ref_emb: its CPU code raises this IndexError, its CUDA code
                # an index assert on the device, which ends the process's
                # use of CUDA.
                raise IndexError(
                    f"ref_emb has {ref_emb.shape[0]} rows, fewer than the {embeddings.shape[0]} of embeddings, "
                    "and ref_labels defaults to labels: pass ref_labels for ref_emb's rows"
                )
            return None
        # PML returns an already-reduced zero when there are at most one
        # positive and one negative pair: at most two pairs in all. A pair
        # is left out per row where labels meet themselves, and per query's
        # copy in a bank.
        left_out = labels_twice or (bank is not None and bank.copies is not None)
        if embeddings.shape[0] * ref_emb.shape[0] - (embeddings.shape[0] if left_out else 0) <= 2:
            return None
        ids = _class_ids(labels, None if labels_twice else ref_labels)
        if ids is None:
            return None
        if self_pairs:
            return ids[0], None, None
        if labels_twice:
            return ids[0], ids[0], torch.arange(embeddings.shape[0], device=embeddings.device)
        return ids[0], ids[1], None if bank is None else bank.copies


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


class DistributedLossWrapper(_pml_distributed.DistributedLossWrapper):
    """pytorch-metric-learning's ``DistributedLossWrapper(loss, efficient=False)``
    (same constructor, same results, errors included) that lets this
    module's ``CircleLoss`` run the op in both modes.

    Both modes gather every rank's embeddings as PML does: this rank's rows
    (with their gradient) first, then the other ranks' (detached), and
    multiply the loss by the world size. efficient=False computes the loss
    of the gathered batch against itself, which ``CircleLoss`` already runs
    on the op. efficient=True computes this rank's rows against the gathered
    batch, each row's own copy left out; PML builds that as an
    ``indices_tuple`` of all the pairs, which would send the loss to PML's
    B × M masks, and this class hands the loss the copies' positions instead
    (``ref_self_index``), as ``CrossBatchMemory`` does. Any other loss, a
    miner's ``indices_tuple``, ``ref_emb`` and ``CrossBatchMemory`` inside
    take PML's own path."""

    def forward_regular_loss(self, emb, labels, indices_tuple, ref_emb, ref_labels, world_size):
        fusable = (
            self.efficient
            and world_size > 1
            and isinstance(self.loss, CircleLoss)
            and labels is not None
            and indices_tuple is None
            and ref_emb is None
            and ref_labels is None
        )
        if not fusable:
            return super().forward_regular_loss(emb, labels, indices_tuple, ref_emb, ref_labels, world_size)
        all_emb, all_labels, labels = _pml_distributed.gather(emb, labels)
        # The own rows are the first len(emb) of the gathered batch. PML keeps
        # a lone row's pair with its copy (its removal takes a batch of one
        # for one that wraps round), and so does this.
        copies = torch.arange(len(emb), device=emb.device) if len(emb) > 1 else None
        return self.loss(emb, labels, _BankPairs(copies, len(all_emb)), all_emb, all_labels) * world_size


class ClassCircleLoss(WeightRegularizerMixin, BaseMetricLossFunction):
    """The class-level Circle Loss as a pytorch-metric-learning
    classification loss, shaped like its ``ArcFaceLoss`` and ``CosFaceLoss``:
    ``ClassCircleLoss(num_classes, embedding_size, m=0.25, gamma=256,
    weight_regularizer=None, weight_reg_weight=1, weight_init_func=None,
    reducer=None, distance=None, embedding_regularizer=None)``, the class
    weights in ``W`` (embedding_size, num_classes) as PML keeps them (its
    default init, normal), optimised with the model. ``forward(embeddings,
    labels, indices_tuple=None)``: each row's loss against every class
    (``circle_loss.class_loss`` on the cosine-normalised rows and classes,
    no B×C logits), weighted by a miner's tuple as PML weights its
    classification losses, reduced by the reducer (mean by default); no
    ``ref_emb``, as for PML's other classification losses. ``sample_rate``
    below 1 samples the classes each step as ``circle_loss.ClassCircleLoss``
    does (Partial FC)."""

    def __init__(self, num_classes, embedding_size, m=CLASS_DEFAULT_MARGIN, gamma=CLASS_DEFAULT_GAMMA,
                 sample_rate=1.0, **kwargs):
        super().__init__(**kwargs)
        c_f.assert_distance_type(self, CosineSimilarity)
        self.num_classes = num_classes
        self.m = m
        self.gamma = gamma
        self.sample_rate = _check_sample_rate(sample_rate, "circle_loss.pml.ClassCircleLoss")
        self.add_to_recordable_attributes(list_of_names=["num_classes", "m", "gamma"], is_stat=False)
        self.W = torch.nn.Parameter(torch.Tensor(embedding_size, num_classes))
        self.weight_init_func(self.W)

    def compute_loss(self, embeddings, labels, indices_tuple, ref_emb, ref_labels):
        c_f.labels_required(labels)
        c_f.ref_not_supported(embeddings, labels, ref_emb, ref_labels)
        # The weights move to the rows' device but keep their dtype (PML's
        # ArcFaceLoss would recast them to half precision for half-precision
        # rows): the op takes them so, their gradient in their own dtype.
        self.W.data = c_f.to_device(self.W.data, device=embeddings.device)
        miner_weights = lmu.convert_to_weights(indices_tuple, labels, dtype=embeddings.dtype)
        classes = self.W.t()  # (num_classes, embedding_size)
        # The cosine's normalisation is the op's own; a distance that does
        # not normalise (or by another norm) is applied as PML applies it.
        inside = bool(self.distance.normalize_embeddings) and self.distance.p == 2
        features = embeddings if inside else self.distance.maybe_normalize(embeddings)
        columns = classes if inside else self.distance.maybe_normalize(classes)
        positions, index = labels, None
        if self.sample_rate < 1.0:
            index, positions = _sampled_classes(labels, self.num_classes, self.sample_rate)
        losses = class_loss(features, positions, columns, float(self.m), float(self.gamma), normalize=inside,
                            class_index=index)
        _check_labels_in_range(labels, self.num_classes, None, "circle_loss.pml.ClassCircleLoss")
        loss_dict = {
            "loss": {
                "losses": losses * miner_weights,
                "indices": c_f.torch_arange_from_size(embeddings),
                "reduction_type": "element",
            }
        }
        if index is not None and self.weight_regularizer is not None:
            classes = classes.index_select(0, index)  # a sampled step regularises the kept classes
        self.add_weight_regularization_to_loss_dict(loss_dict, classes)
        return loss_dict

    def get_logits(self, embeddings):
        """The (B, num_classes) cosine similarities times gamma, for
        inference (a B×C matrix, as asked for)."""
        return self.distance(embeddings, self.W.t()) * self.gamma

    def get_default_distance(self):
        return CosineSimilarity()


__all__ = ["CircleLoss", "ClassCircleLoss", "CrossBatchMemory", "DistributedLossWrapper"]
