"""Classification-head training with the class-level Circle Loss:
circle_loss.ClassCircleLoss, the paper's head for face recognition and
person re-identification, here on scikit-learn's handwritten digits.

The head holds one weight row (a proxy) per class and scores each embedding
against every class, its own the positive; it is trained with the encoder.
Retrieval is then measured as examples/train_digits.py measures it, on
held-out images and from the embeddings alone (the head is not used at test
time): Recall@1 and MAP@R before and after. Writes a PNG with the loss curve
and a 2-D projection of the test embeddings.

    python examples/train_digits_classes.py [--epochs 30] [--device cuda]

The last line printed is `recall@1 before <x> after <y>`.
"""

from __future__ import annotations

import torch

import circle_loss
from train_digits import arguments, digits_split, make_encoder, report, retrieval_metrics, train


def main() -> None:
    args = arguments(__doc__, 128, "train_digits_classes.png").parse_args()

    torch.manual_seed(args.seed)
    x_train, x_test, y_train, y_test = digits_split(args.device, args.seed)
    encoder = make_encoder(args.embedding_dim).to(args.device)
    head = circle_loss.ClassCircleLoss(num_classes=10, embedding_size=args.embedding_dim,
                                       margin=args.margin, gamma=args.gamma).to(args.device)
    optimizer = torch.optim.Adam([*encoder.parameters(), *head.parameters()], lr=args.lr)

    with torch.no_grad():
        before = retrieval_metrics(encoder(x_test), y_test)
    losses, elapsed = train(lambda x, y: head(encoder(x), y), optimizer, x_train, y_train, args.epochs,
                            args.batch_size)  # the head normalises both sides
    report(encoder, x_test, y_test, before, losses, elapsed, args)


if __name__ == "__main__":
    main()
