"""An unchanged PyTorch Lightning program: ``Trainer`` DDP on 2 CPU ranks (fit, validate,
``sync_dist`` logging). Lightning re-launches this script for rank 1 (``sys.argv``).

    python frameworks/lightning_trainer.py
    distcompat run python frameworks/lightning_trainer.py
"""

from __future__ import annotations

import lightning as L
import torch
import torch.distributed as dist
from _common import digest, fault, shapes_for
from torch.utils.data import DataLoader, TensorDataset


class Regression(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)
        )

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        fault(self.global_rank, batch_idx)
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, sync_dist=True)
        metric = torch.full((shapes_for(self.global_rank, batch_idx),), loss.item())
        dist.all_reduce(metric)  # a user's own metric sync
        return loss

    def validation_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def main() -> None:
    L.seed_everything(0, verbose=False)
    generator = torch.Generator().manual_seed(1)
    data = TensorDataset(
        torch.randn(64, 8, generator=generator), torch.randn(64, 1, generator=generator)
    )
    model = Regression()
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy="ddp", max_epochs=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(model, DataLoader(data, batch_size=8), DataLoader(data, batch_size=16))
    [result] = trainer.validate(model, DataLoader(data, batch_size=16), verbose=False)
    rank = trainer.global_rank
    print(f"rank {rank}: loss {result['val_loss']!r}", flush=True)
    print(f"rank {rank}: digest {digest(list(model.parameters()))}", flush=True)


if __name__ == "__main__":
    main()
