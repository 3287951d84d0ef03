"""The smallest use of circle_loss: the loss of a batch and one training step."""

import torch

import circle_loss

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)

encoder = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 16)).to(device)
criterion = circle_loss.CircleLoss(margin=0.25, gamma=64.0)
optimizer = torch.optim.SGD(encoder.parameters(), lr=0.05)

inputs = torch.randn(256, 32, device=device)
labels = torch.randint(0, 8, (256,), device=device)

for step in range(2):
    embeddings = torch.nn.functional.normalize(encoder(inputs), dim=1)
    loss = criterion(embeddings, labels)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    print(f"step {step}: loss {loss.item():.4f}")
