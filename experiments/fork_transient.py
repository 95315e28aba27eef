# Why does a fresh zero-output block lose to no block under the run's own SGD? Manual fork, full F-MNIST.
import copy, math, sys, time, torch, torch.nn.functional as F
torch.set_num_threads(1)
from growtrain.data import ImageDataModule
from growtrain.module import ImageClassifier
from growtrain.optim import param_groups
from growtrain.fork import make_arm
torch.manual_seed(0)
dm = ImageDataModule(dataset="fashion-mnist", root="/usr/share/datasets/fashion-mnist", augment=False, probe_size=2000, val_size=1000)
dm.setup("fit")
from growtrain.data.transforms import normalize_batch
tl = dm.train_dataloader()
probe = [(x, y) for x, y in dm.probe_dataloader()]
def norm(b):
    x, y = b
    return normalize_batch(x, dm.mean, dm.std), y
net = ImageClassifier(in_channels=1).network
opt = torch.optim.SGD(param_groups(net), lr=0.05, momentum=0.9, weight_decay=5e-4)
def step(n, o, b, lrmul=None, steps=0):
    n.train(); o.zero_grad(); F.cross_entropy(n(b[0]), b[1]).backward(); o.step()
def ev(n):
    n.eval()
    with torch.no_grad():
        return sum(F.cross_entropy(n(x), y, reduction="sum").item() for x, y in probe) / 2000
E0 = int(sys.argv[1]) if len(sys.argv) > 1 else 1
site = sys.argv[2] if len(sys.argv) > 2 else "layer1.0"
for e in range(E0):
    for b in tl: step(net, opt, norm(b))
print("base after", E0, "epochs", ev(net), flush=True)
arms = {}
arms["zero"] = make_arm(net, opt, site, seed=1)
arms["zero_warm"] = make_arm(net, opt, site, seed=1)
arms["zero_lr0.1"] = make_arm(net, opt, site, seed=1)
n0 = len(opt.param_groups)
t = 0
for e in range(4):
    for b in tl:
        b = norm(b); t += 1
        step(net, opt, b)
        for k, (a, ao, blk, refs) in arms.items():
            for g in ao.param_groups[n0:]:
                g["lr"] = 0.05 * (min(1.0, t / 445) if k == "zero_warm" else 0.1 if k == "zero_lr0.1" else 1.0)
            step(a, ao, b)
        if t % 222 == 0:
            c = ev(net)
            print(t, "control", round(c, 4), {k: round((c - ev(a[0])) / c * 100, 2) for k, a in arms.items()}, flush=True)
