"""A user's DDP script in the shape of pytorch/examples' ``ddp-tutorial-series``
(``multigpu_torchrun.py``), on the CPU with gloo: a ``Trainer`` class, a
``DistributedSampler``, its own snapshot file that rank 0 saves every N epochs and every
rank loads at start, ``init_process_group`` / ``destroy_process_group()``. Written as a
user would, with nothing of elastic_train: the tests run it unmodified under
``elastic-train run`` and ``torchrun``.

``--pace`` (seconds per batch) only slows it enough for a test to kill a worker mid-run.
"""

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class MyTrainDataset(Dataset):
    def __init__(self, size):
        self.size = size
        generator = torch.Generator().manual_seed(0)
        self.data = [(torch.rand(20, generator=generator), torch.rand(1, generator=generator))
                     for _ in range(size)]

    def __len__(self):
        return self.size

    def __getitem__(self, index):
        return self.data[index]


def ddp_setup():
    init_process_group(backend="gloo")


class Trainer:
    def __init__(self, model, train_data, optimizer, save_every, snapshot_path, pace):
        self.local_rank = int(os.environ["LOCAL_RANK"])
        self.global_rank = int(os.environ["RANK"])
        self.model = model
        self.train_data = train_data
        self.optimizer = optimizer
        self.save_every = save_every
        self.epochs_run = 0
        self.snapshot_path = snapshot_path
        self.pace = pace
        if os.path.exists(snapshot_path):
            print("Loading snapshot")
            self._load_snapshot(snapshot_path)
        self.model = DDP(self.model)

    def _load_snapshot(self, snapshot_path):
        snapshot = torch.load(snapshot_path, map_location="cpu")
        self.model.load_state_dict(snapshot["MODEL_STATE"])
        self.epochs_run = snapshot["EPOCHS_RUN"]
        print(f"Resuming training from snapshot at Epoch {self.epochs_run}")

    def _run_batch(self, source, targets):
        self.optimizer.zero_grad()
        output = self.model(source)
        loss = F.mse_loss(output, targets)
        loss.backward()
        self.optimizer.step()

    def _run_epoch(self, epoch):
        b_sz = len(next(iter(self.train_data))[0])
        print(f"[RANK{self.global_rank}] Epoch {epoch} | Batchsize: {b_sz} | "
              f"Steps: {len(self.train_data)}", flush=True)
        self.train_data.sampler.set_epoch(epoch)
        for source, targets in self.train_data:
            self._run_batch(source, targets)
            if self.pace:
                time.sleep(self.pace)

    def _save_snapshot(self, epoch):
        snapshot = {"MODEL_STATE": self.model.module.state_dict(), "EPOCHS_RUN": epoch + 1}
        tmp = f"{self.snapshot_path}.tmp"
        torch.save(snapshot, tmp)
        os.replace(tmp, self.snapshot_path)
        print(f"Epoch {epoch} | Training snapshot saved at {self.snapshot_path}", flush=True)

    def train(self, max_epochs):
        for epoch in range(self.epochs_run, max_epochs):
            self._run_epoch(epoch)
            if self.global_rank == 0 and epoch % self.save_every == 0:
                self._save_snapshot(epoch)


def load_train_objs():
    train_set = MyTrainDataset(512)
    model = torch.nn.Linear(20, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    return train_set, model, optimizer


def prepare_dataloader(dataset, batch_size):
    return DataLoader(dataset, batch_size=batch_size, shuffle=False,
                      sampler=DistributedSampler(dataset))


def main(save_every, total_epochs, batch_size, snapshot_path, pace):
    ddp_setup()
    dataset, model, optimizer = load_train_objs()
    train_data = prepare_dataloader(dataset, batch_size)
    trainer = Trainer(model, train_data, optimizer, save_every, snapshot_path, pace)
    trainer.train(total_epochs)
    destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="simple distributed training job")
    parser.add_argument("total_epochs", type=int, help="Total epochs to train the model")
    parser.add_argument("save_every", type=int, help="How often to save a snapshot")
    parser.add_argument("--batch_size", default=32, type=int)
    parser.add_argument("--snapshot_path", default="snapshot.pt")
    parser.add_argument("--pace", default=0.0, type=float, help="seconds per batch")
    parser.add_argument("--exit-code", default=0, type=int, help="exit with this at the end")
    args = parser.parse_args()
    main(args.save_every, args.total_epochs, args.batch_size, args.snapshot_path, args.pace)
    print(f"[RANK{os.environ['RANK']}] done", flush=True)
    sys.exit(args.exit_code)
