"""A Lightning script as a user writes one, ``Trainer(accelerator="cpu", devices=2, strategy="ddp")``,
with no meshscope in it: third-party code for tests/test_zerocode.py (launched by torchrun, which
Lightning detects)."""

import argparse
import json
import os

import lightning as L
import torch
import torch.nn as nn


class TinyLM(L.LightningModule):
    def __init__(self, vocab=256, dim=64):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.block = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.head = nn.Linear(dim, vocab)
        self.losses = []

    def forward(self, ids):
        return self.head(self.block(self.embed(ids)))

    def training_step(self, batch, batch_idx):
        (ids,) = batch
        logits = self(ids[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1))
        self.log("train_loss", loss)
        self.losses.append(loss.item())  # the job's own record of each micro-batch's loss
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--accumulate", type=int, default=1)
    args = parser.parse_args()
    data = torch.utils.data.TensorDataset(torch.randint(0, 256, (512, 33), generator=torch.Generator().manual_seed(0)))
    loader = torch.utils.data.DataLoader(data, batch_size=8)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=args.steps,
                        accumulate_grad_batches=args.accumulate, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    torch.manual_seed(0)  # the same initial weights in every run (a run with meshscope and one without compare)
    model = TinyLM()
    trainer.fit(model, loader)
    with open(os.path.join(args.out, f"lightning-rank{trainer.global_rank}.json"), "w") as f:
        json.dump({"global_step": trainer.global_step, "losses": model.losses}, f)


if __name__ == "__main__":
    main()
