"""What the simulator assumes about the models named in traces: checkpoint size and skew.

Skew S_J is the share of the model's parameters held by its largest tensor, the quantity Tiresias's Table 6
uses to separate placement-sensitive models (VGG family, AlexNet: one huge fully connected tensor) from the rest.
Values are computed from the standard architectures (parameter counts of the torchvision / TF-slim definitions,
1000 classes); the checkpoint size is fp32 weights (4 bytes x parameters).

    model        params        largest tensor                 skew
    vgg11        132,863,336   fc6 25088x4096 = 102,760,448   0.77
    vgg16        138,357,544   fc6                            0.74
    vgg19        143,667,240   fc6                            0.72
    alexnet       61,100,840   fc6 9216x4096 = 37,748,736     0.62
    resnet50      25,557,032   conv 3x3x512x512 = 2,359,296   0.09
    resnet101     44,549,160   same                           0.05
    resnet152     60,192,808   same                           0.04
    inception3    27,161,264   fc 2048x1000 = 2,048,000       0.08
    inception4    42,679,816   fc 1536x1000 = 1,536,000       0.04
    googlenet      6,624,904   fc 1024x1000 = 1,024,000       0.15

Pollux workload applications (petuum/adaptdl osdi21-artifact): cifar10 = ResNet-18 CIFAR (11.2 M parameters,
largest tensor 3x3x512x512), imagenet = ResNet-50, bert = BERT-base (110 M, word embeddings 30522x768),
yolov3 (61.9 M, largest conv 3x3x512x1024). deepspeech2 and ncf: skew unknown (treated as not skewed); their
parameter counts (38 M, 5 M) are rough guesses that only set a checkpoint cost.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ModelInfo:
    params: int
    skew: float | None

    @property
    def checkpoint_bytes(self) -> float:
        return 4.0 * self.params


MODELS: dict[str, ModelInfo] = {
    "vgg11": ModelInfo(132_863_336, 0.77),
    "vgg16": ModelInfo(138_357_544, 0.74),
    "vgg19": ModelInfo(143_667_240, 0.72),
    "alexnet": ModelInfo(61_100_840, 0.62),
    "resnet50": ModelInfo(25_557_032, 0.09),
    "resnet101": ModelInfo(44_549_160, 0.05),
    "resnet152": ModelInfo(60_192_808, 0.04),
    "inception3": ModelInfo(27_161_264, 0.08),
    "inception4": ModelInfo(42_679_816, 0.04),
    "googlenet": ModelInfo(6_624_904, 0.15),
    # Pollux applications
    "cifar10": ModelInfo(11_173_962, 0.21),
    "imagenet": ModelInfo(25_557_032, 0.09),
    "bert": ModelInfo(110_000_000, 0.21),
    "yolov3": ModelInfo(61_949_149, 0.08),
    "deepspeech2": ModelInfo(38_000_000, None),
    "ncf": ModelInfo(5_000_000, None),
}

#: Checkpoint size assumed for jobs whose model is unknown (openb pods, Philly rows): 200 MB, the order of the
#: ResNet/Inception models above. A simulator knob can override it.
DEFAULT_CHECKPOINT_BYTES = 200e6


def model_info(name: str) -> ModelInfo | None:
    """The catalogue entry for a model name (case-insensitive), or None."""
    return MODELS.get(name.strip().lower())
