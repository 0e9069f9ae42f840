"""Training drafters by self-distillation from a frozen target: MTP layers, DFlash block drafters, EAGLE-3 heads.

    data            the target's hidden states over text windows and over its own greedy generations, cached once
    losses          the teacher-forced MTP chain, KL to the target's own next-token distribution, replayed acceptance
    step            AdamW with warmup and cosine decay, jit-compiled steps over the drafter's parameters only
    loop            the loop (batches, orbax checkpoints with resume, held-out evaluation, the loss plot); MTP's train
    export          attaching fresh MTP layers to a Llama/Qwen2 target; writing trained ones where jaxspec.load
                    finds them
    dflash_data     the target's answers with its tapped layers' outputs, the context a DFlash drafter reads
    dflash_losses   the DFlash objective: blocks at random anchors of each answer, position-weighted KL
    dflash_export   a fresh DFlash drafter for a Llama/Qwen2/Qwen3 target; writing it in z-lab's layout
    dflash_loop     train_dflash, its held-out block acceptance and plot
    eagle3_losses   EAGLE-3's training-time test: chained steps over every index, decay-weighted KL on the draft
                    vocabulary
    eagle3_export   a fresh EAGLE-3 head and its draft vocabulary; writing it in the layout vLLM and SGLang load
    eagle3_loop     train_eagle3 (on a DFlash corpus tapped at the head's layers), its replayed chain acceptance

Imports the models, never the decode loop: the output is a model `jaxspec.load` reads, so a trained drafter is just
a model. `scripts/train_mtp.py`, `scripts/train_dflash.py` and `scripts/train_eagle3.py` are the command lines.
"""

from .data import Corpus
from .dflash_data import BlockCorpus
from .dflash_export import new_dflash_drafter, save_dflash_drafter, with_draft_vocab
from .dflash_loop import DFlashTrainConfig, plot_dflash_history, train_dflash
from .eagle3_export import draft_vocabulary_for, new_eagle3_head, save_eagle3_head
from .eagle3_loop import Eagle3TrainConfig, plot_eagle3_history, train_eagle3
from .export import attach_mtp_layers, save_mtp_asset, with_trained
from .loop import TrainConfig, TrainResult, plot_history, train
from .step import OptimConfig

__all__ = ["BlockCorpus", "Corpus", "DFlashTrainConfig", "Eagle3TrainConfig", "OptimConfig", "TrainConfig",
           "TrainResult", "attach_mtp_layers", "draft_vocabulary_for", "new_dflash_drafter", "new_eagle3_head",
           "plot_dflash_history", "plot_eagle3_history", "plot_history", "save_dflash_drafter", "save_eagle3_head",
           "save_mtp_asset", "train", "train_dflash", "train_eagle3", "with_draft_vocab", "with_trained"]
