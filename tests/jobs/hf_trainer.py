"""A Hugging Face ``Trainer`` fine-tuning a tiny causal LM built from a config (random init, nothing
downloaded), as a user writes one, with no meshscope in it (unless --meshscope-callback adds the one-line
integration): third-party code for tests/test_zerocode_frameworks.py. Under torchrun it trains with DDP."""

import argparse
import json
import os

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments


class RandomTokens(torch.utils.data.Dataset):
    def __init__(self, n, seq, vocab):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (n, seq), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--meshscope-callback", action="store_true", help="the one-line integration, no launcher")
    args = parser.parse_args()
    config = GPT2Config(vocab_size=512, n_positions=64, n_embd=64, n_layer=2, n_head=2)
    torch.manual_seed(0)  # the same initial weights in every run (a run with meshscope and one without compare)
    model = GPT2LMHeadModel(config)
    training = TrainingArguments(
        output_dir=args.out, max_steps=args.steps, per_device_train_batch_size=4,
        gradient_accumulation_steps=args.accumulate, learning_rate=1e-3, logging_steps=1, save_strategy="no",
        report_to=[], use_cpu=True, ddp_backend="gloo", dataloader_num_workers=0, disable_tqdm=True,
    )
    callbacks = []
    if args.meshscope_callback:
        import meshscope

        callbacks.append(meshscope.TransformersCallback())
    trainer = Trainer(model=model, args=training, train_dataset=RandomTokens(256, 32, config.vocab_size),
                      callbacks=callbacks)
    trainer.train()
    if trainer.is_world_process_zero():
        with open(os.path.join(args.out, "log_history.json"), "w") as f:
            json.dump({"global_step": trainer.state.global_step, "log": trainer.state.log_history}, f)


if __name__ == "__main__":
    main()
