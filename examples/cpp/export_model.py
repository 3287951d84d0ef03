"""Saves the TorchScript model, its AOTInductor package (torch.export, then
torch._inductor.aoti_compile_and_package) and the inputs that the C++ example
runs, and prints the loss Python computes for them (`python loss <value>`)."""

import sys
from pathlib import Path

import torch

import circle_loss


class EmbeddingLoss(torch.nn.Module):
    """A projection head and its Circle Losses, the global form plus the mean
    per-anchor one plus the class-level head's: forward(features, labels) -> loss."""

    def __init__(self) -> None:
        super().__init__()
        self.head = torch.nn.Linear(32, 16)
        self.criterion = circle_loss.CircleLoss(margin=0.25, gamma=64.0)
        self.anchor_criterion = circle_loss.AnchorCircleLoss(margin=0.25, gamma=64.0)
        self.class_head = circle_loss.ClassCircleLoss(num_classes=10, embedding_size=16, margin=0.25, gamma=64.0)

    def forward(self, features: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        embeddings = torch.nn.functional.normalize(self.head(features), dim=1)
        return (self.criterion(embeddings, labels) + self.anchor_criterion(embeddings, labels)
                + self.class_head(embeddings, labels))


class Inputs(torch.nn.Module):
    """Tensors in TorchScript's container format, which C++ reads directly."""

    def __init__(self, features: torch.Tensor, labels: torch.Tensor) -> None:
        super().__init__()
        self.features = features
        self.labels = labels


def main(out: Path) -> None:
    torch.manual_seed(0)
    out.mkdir(parents=True, exist_ok=True)
    model = EmbeddingLoss().eval()
    features = torch.randn(200, 32)
    labels = torch.randint(0, 10, (200,))
    torch.jit.script(model).save(str(out / "model.pt"))
    torch.jit.script(Inputs(features, labels)).save(str(out / "inputs.pt"))
    batch = torch.export.Dim("batch", min=2)
    program = torch.export.export(model, (features, labels), dynamic_shapes=({0: batch}, {0: batch}))
    torch._inductor.aoti_compile_and_package(program, package_path=str(out / "model.pt2"))
    with torch.no_grad():
        print(f"python loss {model(features, labels).item():.10g}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
