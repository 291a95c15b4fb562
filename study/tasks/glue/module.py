"""The LightningModule of one GLUE task: the encoder, a pooled classifier (or regressor, STS-B), the official dev
metrics on the 0-100 scale, and test-set predictions in the server's format."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from study.config import ExperimentConfig
from study.io import atomic_write
from study.model.transformer import SequenceClassificationHead
from study.tasks.base import StudyModule
from study.tasks.data.glue import DEV_SUFFIX, GlueTaskInfo, glue_task_info
from study.tasks.glue.data import GlueDataModule
from study.tasks.glue.metrics import compute_metrics, task_score
from study.tasks.glue.pretrained import load_encoder_weights
from study.tasks.glue.submission import submission_name, write_submission


class GlueModule(StudyModule):
    output_paths = ("classifier.pt", "predictions")

    def __init__(self, cfg: ExperimentConfig):
        super().__init__(cfg)
        self.info = glue_task_info(cfg.task.dataset)
        self.head = SequenceClassificationHead(cfg.model, self.info.num_labels)
        if cfg.task.init_from and cfg.task.pretrained_weights:
            load_encoder_weights(self.model, Path(cfg.task.init_from) / "model.pt")
        self.test_predictions: dict[str, list[tuple[int, Any]]] = {}

    def unused_heads(self) -> tuple[str, ...]:
        return ("mlm_head.", "nsp_head.")  # kept for the pretrained weights' shape; the classifier reads the pooler

    def logits(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        h = self.forward_model(batch["input_ids"], token_type_ids=batch["token_type_ids"], padding_mask=batch.get("padding_mask"))
        pooled = self.model.pooled(h, batch.get("padding_mask"), self.cfg.task.pooling)
        return self.head(pooled).float()

    def training_loss(self, batch) -> tuple[torch.Tensor, int]:
        out = self.logits(batch)
        if self.info.is_regression:
            loss = F.mse_loss(out.squeeze(-1), batch["labels"])
        else:
            loss = F.cross_entropy(out, batch["labels"])
        tokens = batch["padding_mask"].sum() if "padding_mask" in batch else batch["input_ids"].numel()  # read later
        return loss, tokens

    def validation_loss(self, batch) -> tuple[torch.Tensor, int]:
        """(mean loss over the batch's examples, its examples): the loss is a mean per example, so the epoch's
        `val/loss` weights each batch by its examples; weighted by tokens, the long-sentence batches of the
        length-sorted dev set would dominate the curve (and tuning's pruner, which reads it)."""
        loss, _ = self.training_loss(batch)
        return loss, int(batch["labels"].shape[0])

    @torch.no_grad()
    def predict(self, dm: GlueDataModule, split: str) -> list:
        """Predicted class ids (scores for STS-B) for every example of a split, in file order."""
        self.model.eval()
        self.head.eval()
        batches, order = dm.batches(split, with_labels=False)
        flat: list = []
        for batch in batches:
            batch = {k: v.to(self.device) for k, v in batch.items()}
            with self.precision_context():
                out = self.logits(batch)
            flat += (out.squeeze(-1) if self.info.is_regression else out.argmax(-1)).tolist()
        preds: list = [None] * len(order)
        for j, p in zip(order, flat):
            preds[j] = p
        return preds

    def final_metrics(self, dm: GlueDataModule) -> dict[str, Any]:
        info = self.info
        dev = {split: compute_metrics(info.metrics, dm.labels[split], self.predict(dm, split))
               for split in info.eval_splits}
        for split in info.test_splits:
            if split in dm.encoded:
                idxs = [e.idx for e in dm.data[split]]
                self.test_predictions[split] = list(zip(idxs, self.predict(dm, split)))
        return {"task": info.name, "score": task_score(dev), **flat_metrics(info, dev), "dev": dev,
                "n_train": dm.n_train, "n_dev": {s: len(dm.encoded[s]) for s in info.eval_splits},
                "truncated": {s: dm.truncated[s] for s in (info.train_split, *info.eval_splits)}}

    def save_outputs(self, run_dir: Path) -> None:
        """The classifier head (model.pt holds the encoder) and the test predictions in the GLUE server format."""
        atomic_write(Path(run_dir) / "classifier.pt", lambda p: torch.save(self.head.state_dict(), p))
        for split, rows in self.test_predictions.items():
            write_submission(Path(run_dir) / "predictions" / f"{submission_name(self.info.name, split)}.tsv", self.info, rows)


def flat_metrics(info: GlueTaskInfo, dev: dict[str, dict[str, float]]) -> dict[str, float]:
    """{metric: value} for a single dev split; MNLI's become accuracy_m and accuracy_mm."""
    if len(info.eval_splits) == 1:
        return dict(dev[info.eval_splits[0]])
    return {f"{k}_{DEV_SUFFIX.get(split, split)}": v for split in info.eval_splits for k, v in dev[split].items()}
