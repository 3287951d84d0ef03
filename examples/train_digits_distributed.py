"""Data-parallel training with the three distributed forms of circle_loss.

The digits embedding of examples/train_digits.py, trained by several
processes: each rank takes its share of every batch, the encoder runs under
DistributedDataParallel, and the loss is the *global* batch's (every rank's
rows against every rank's), as one process on the whole batch would compute it:

    torchrun --nproc_per_node=2 examples/train_digits_distributed.py --form loss
    torchrun --nproc_per_node=2 examples/train_digits_distributed.py --form anchor
    torchrun --nproc_per_node=2 examples/train_digits_distributed.py --form class

--form loss    circle_loss.distributed.CircleLoss (the global form)
--form anchor  circle_loss.distributed.AnchorCircleLoss (PML's per-anchor form)
--form class   circle_loss.distributed.ClassCircleLoss (the class-level head,
               its classes sharded over the ranks, kept outside DDP)

gloo on the CPU, NCCL with --device cuda (one GPU a rank). Rank 0 measures
retrieval on the held-out split before and after; its last line is
`recall@1 before <x> after <y>`.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

import circle_loss.distributed
from train_digits import arguments, digits_split, make_encoder, report, retrieval_metrics, train


def main() -> None:
    parser = arguments(__doc__, 256, "train_digits_distributed.png")
    parser.add_argument("--form", choices=("loss", "anchor", "class"), default="loss")
    args = parser.parse_args()
    if "RANK" not in os.environ:
        parser.error("start it with torchrun (e.g. torchrun --nproc_per_node=2 ...): it needs a process group")
    on_cuda = args.device.startswith("cuda")
    if on_cuda:
        args.device = f"cuda:{int(os.environ['LOCAL_RANK'])}"
        torch.cuda.set_device(args.device)
    dist.init_process_group("nccl" if on_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    # The same seed everywhere: the same split, the same initial encoder and
    # the same batch order on every rank; each rank keeps its slice of a batch.
    torch.manual_seed(args.seed)
    x_train, x_test, y_train, y_test = digits_split(args.device, args.seed)
    encoder = make_encoder(args.embedding_dim).to(args.device)
    model = torch.nn.parallel.DistributedDataParallel(encoder)

    # Every form's value is the global batch's loss on every rank, and its
    # backward gives this rank's rows the gradient that DDP's average over
    # the ranks turns into the global loss's (reduce_grads="mean", the
    # default): the learning rate is one process's on the whole batch.
    if args.form == "class":
        head = circle_loss.distributed.ClassCircleLoss(10, args.embedding_dim, args.margin, args.gamma).to(args.device)
        parameters = [*model.parameters(), *head.parameters()]  # the head stays outside DDP

        def loss_of_batch(inputs, labels):
            return head(model(inputs), labels)
    else:
        form = circle_loss.distributed.CircleLoss if args.form == "loss" else circle_loss.distributed.AnchorCircleLoss
        criterion = form(args.margin, args.gamma)
        parameters = list(model.parameters())

        def loss_of_batch(inputs, labels):
            return criterion(F.normalize(model(inputs), dim=1), labels)

    optimizer = torch.optim.Adam(parameters, lr=args.lr)

    def step_on_my_rows(inputs, labels):  # train() hands every rank the whole batch
        mine = torch.tensor_split(torch.arange(len(inputs), device=inputs.device), world)[rank]
        return loss_of_batch(inputs[mine], labels[mine])

    with torch.no_grad():
        before = retrieval_metrics(encoder(x_test), y_test)
    losses, elapsed = train(step_on_my_rows, optimizer, x_train, y_train, args.epochs, args.batch_size,
                            progress=rank == 0)
    if rank == 0:
        print(f"{args.form} form on {world} ranks, {args.batch_size} rows a step in all")
        report(encoder, x_test, y_test, before, losses, elapsed, args)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
