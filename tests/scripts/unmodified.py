"""A DDP script that knows nothing of ddpwatch, with spawn-started data-loader workers."""

import time

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def main() -> None:
    print("loading data", flush=True)
    dist.init_process_group("gloo")
    model = nn.parallel.DistributedDataParallel(nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = DataLoader(
        TensorDataset(torch.randn(64, 8)),
        batch_size=4,
        num_workers=1,
        multiprocessing_context="spawn",
    )
    for _ in range(3):
        for (x,) in data:
            loss = model(x).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            time.sleep(0.05)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
