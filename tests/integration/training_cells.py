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

# A model of `depth` blocks (Linear + LayerNorm, `width` wide) and a cell that builds it (under
# `shard.init_module()` or not), prepares it with SGD and trains one step, recording this rank's
# peak resident memory above the cell's start after each phase (Linux's VmHWM, reset at the start)
# and the mean loss over ranks. `big` is the record.
BIG_MODEL = """
import contextlib, gc, resource, torch
from torch import nn
torch.set_num_threads(1)

class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.linear, self.norm = nn.Linear(width, width), nn.LayerNorm(width)
    def forward(self, x):
        return self.norm(torch.relu(self.linear(x)))

def _kib(key):
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) * 1024 for line in fh if line.startswith(key))

def _reset_peak():
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")

def train_big(width, depth, sharded):
    gc.collect()
    _reset_peak()
    base, peaks = _kib("VmRSS:"), {}
    torch.manual_seed(0)
    with shard.init_module() if sharded else contextlib.nullcontext():
        model = nn.Sequential(*[Block(width) for _ in range(depth)])
    peaks["build"] = _kib("VmHWM:") - base
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = shard.prepare(model, opt)
    peaks["prepare"] = _kib("VmHWM:") - base
    x = torch.randn(4, width, generator=torch.Generator().manual_seed(shard.rank))
    loss = model(x).pow(2).mean()
    shard.backward(loss)
    shard.step()
    peaks["step"] = _kib("VmHWM:") - base
    total = loss.detach().clone()
    torch.distributed.all_reduce(total)
    return {
        "model_bytes": 4 * depth * (width * width + 3 * width),
        "peaks": peaks,
        "loss": total.item() / shard.world_size,
        "held": shard.memory(),
        "maxrss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }
"""
