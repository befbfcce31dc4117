"""Notebook cells shared by the strategy tests: a small model, a fixed global batch, and a single-process
reference trained in the same cell, so each strategy is compared with plain PyTorch."""

# Builds the model and an optimizer on the unwrapped model, the batches, and helpers; `mine` is this
# rank's half of a global batch.
SETUP = """
import copy, torch
from torch import nn
torch.manual_seed(0)
net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
opt = torch.optim.AdamW(net.parameters(), lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.01)
g = torch.Generator().manual_seed(1)
batches = [(torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)) for _ in range(6)]
fixed_x, fixed_y = batches[-1]
def mine(x):
    return x[shard.rank * 4:(shard.rank + 1) * 4]
def fixed_loss():
    with torch.no_grad():
        return nn.functional.mse_loss(model(fixed_x), fixed_y).item()
"""

# Trains a single-process reference on the full batches (under bf16 autocast when the pool is
# bf16-mixed) and the prepared model on this rank's halves; `rel` is the largest relative difference
# between the reference losses and the mean of the ranks' losses.
LOSS_PARITY = """
ref = copy.deepcopy(net)
ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.01)
ref_losses, losses = [], []
for x, y in batches[:5]:
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=shard.impl.ctx.precision == "bf16-mixed"):
        loss = nn.functional.mse_loss(ref(x), y)
    loss.backward(); ref_opt.step(); ref_opt.zero_grad(); ref_losses.append(loss.item())
model, opt = shard.prepare(net, opt)
for x, y in batches[:5]:
    loss = nn.functional.mse_loss(model(mine(x)), mine(y))
    shard.backward(loss); shard.step()
    mean = loss.detach().float().clone(); torch.distributed.all_reduce(mean); losses.append(mean.item() / 2)
rel = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
"""
