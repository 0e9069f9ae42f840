"""Training MTP (multi-token prediction) layers by self-distillation from a frozen target.

    data    the target's hidden states over text windows and over its own greedy generations, cached once
    losses  the teacher-forced MTP chain, KL to the target's own next-token distribution, replayed acceptance
    step    AdamW with warmup and cosine decay, one jit-compiled step over the MTP parameters only
    loop    batches, orbax checkpoints with resume, held-out acceptance, the loss plot
    export  attaching fresh layers to a Llama/Qwen2 target, writing trained ones where jaxspec.load finds them

Imports the models, never the decode loop: the output is a model `jaxspec.load` reads, so a trained drafter is just
a model. `scripts/train_mtp.py` is the command line.
"""

from .data import Corpus
from .export import attach_mtp_layers, save_mtp_asset, with_trained
from .loop import TrainConfig, TrainResult, plot_history, train
from .step import OptimConfig

__all__ = ["Corpus", "OptimConfig", "TrainConfig", "TrainResult", "attach_mtp_layers", "plot_history",
           "save_mtp_asset", "train", "with_trained"]
