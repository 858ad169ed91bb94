"""The papers' networks: Krizhevsky's cuda-convnet CIFAR-10 network (layers-18pct) and the one-tower
AlexNet of "One weird trick" (Krizhevsky 2014, arXiv 1404.5997), as lists of layers (no ops).

    cifar10_18pct()                      CIFAR-10, 3x32x32 -> 10; 89,578 parameters
    alexnet_1gpu()                       ImageNet, 3x224x224 -> 1000; 61,100,840 parameters
    alexnet_1gpu(size=64)                the same depth for 3x64x64 inputs; 40,110,888 parameters

Both follow cuda-convnet's layer files; each builder's docstring maps every setting of the file to
ours and names every place where we differ. How cuda-convnet's per-layer settings map here:

  * initW (std of a zero-mean normal) -> init="normal", std=initW.
  * epsW / epsB (learning rates) -> --lr = the file's epsW, lr_mult 1 on weights and
    bias_lr_mult = epsB / epsW on biases. cuda-convnet scales the minibatch's summed gradient by
    eps / numCases (`getEps() / numCases` in every layer's bpropWeights/bpropBiases; weights.cuh
    then adds it to the increment): its eps is a step size on the minibatch's *mean* gradient, as
    --lr is here (Model.forward_backward averages the loss over the minibatch). No rescaling by the
    batch size is needed.
  * wc (weight decay) -> --weight-decay = the convolutions' wc, decay_mult = wc / that on each
    layer. cuda-convnet subtracts eps * wc * W from the increment once per update (not per
    image), as d <- g + weight_decay * decay_mult * w does in `mpiasgd.optim.SGD`. Biases have no
    wc there: bias_decay_mult 0.
  * momW / momB -> --momentum (both 0.9 in these files). cuda-convnet keeps eps inside the
    velocity (inc <- mom * inc + eps * g; W <- W + inc); `mpiasgd.optim.SGD` multiplies the
    velocity by lr, which is the same update while lr is constant (see its docstring).
  * pool (sizeX, stride; start 0, outputsX 0) -> MaxPool2d / AvgPool2d(sizeX, stride,
    ceil_mode=True): cuda-convnet's output size is ceil((size - sizeX) / stride) + 1 and its last
    windows are clipped at the border; avg divides by the clipped window's pixel count (AvgPooler's
    `a / regionSize`), which is `ops.avgpool_fprop`'s divisor with pad 0.
  * neuron=relu on a layer -> ReLU after it (cuda-convnet applies a layer's neuron to its output,
    so `neuron=relu` on a max pool is relu after the pool; the two commute).
  * cmrnorm (size, scale, pow, minDiv) -> LocalResponseNorm(size, alpha=scale, beta=pow,
    k=minDiv). cuda-convnet's layer.py divides the file's scale by size before the kernel sees it
    (`dic['scale'] /= dic['size']` for cross-map), so the file's scale is torch's alpha, whose
    formula (k + alpha/size * sum x^2)^-beta is ours. minDiv is cuda-convnet2's (default 1.0);
    cuda-convnet's kernels add a constant 1 (`1 + addScale * ...`): k = 1.
"""

from __future__ import annotations

from mpiasgd.model.layers import (
    AvgPool2d,
    Conv2d,
    Dropout,
    Flatten,
    Layer,
    Linear,
    LocalResponseNorm,
    MaxPool2d,
    ReLU,
)

ALEXNET_SIZES = (224, 64)  # input sizes `alexnet_1gpu` has a first layer for


def cifar10_18pct(num_classes: int = 10) -> list[Layer]:
    """Krizhevsky's cuda-convnet CIFAR-10 network, "18% error on CIFAR-10 in 20 minutes":
    example-layers/layers-18pct.cfg and layer-params-18pct.cfg (cuda-convnet, 2011-2012). Input
    (3, 32, 32), 89,578 parameters:

        conv1  5x5, 32, pad 2, initW 1e-4   (no neuron)    32x32x32
        pool1  max 3/2 ceil, then relu                     32x16x16
        rnorm1 size 3, scale 5e-5, pow 0.75                 (see "Differs" below)
        conv2  5x5, 32, pad 2, initW 0.01, relu             32x16x16
        pool2  avg 3/2 ceil                                 32x8x8
        rnorm2 size 3, scale 5e-5, pow 0.75
        conv3  5x5, 64, pad 2, initW 0.01, relu             64x8x8
        pool3  avg 3/2 ceil                                 64x4x4
        fc10   1024 -> 10, initW 0.01

    conv 2,432 + 25,632 + 51,264, fc 10,250 (with `num_classes` outputs: 1024 * num_classes +
    num_classes). layer-params-18pct.cfg: epsW 0.001, epsB 0.002, momW = momB = 0.9 everywhere;
    wc 0.004 on the convolutions and 1 on fc10. So: bias_lr_mult 2, decay_mult 1 on the conv
    weights and 250 (= 1 / 0.004) on fc10's, none on biases.

    Recommended: --lr 0.001 --weight-decay 0.004 --momentum 0.9 --batch-size 128 (cuda-convnet's
    default minibatch) --warmup-epochs 0 --lr-schedule step --lr-milestones 120,130 --lr-gamma 0.1
    --epochs 140 (the file: "Reduce all learning rates by factor of 10 after 120 epochs. Then
    another factor of 10 after 10 more epochs."). Asynchronous workers may need a lower --lr.

    Differs from cuda-convnet:
      * rnorm: the file's layers are `type=rnorm`, cuda-convnet's *within-map* response
        normalisation: each value divided by (1 + scale/size^2 * sum of squares over the size x size
        pixels around it in its own map)^pow. mpiasgd has only the cross-map kind (cmrnorm), used
        here with the same size, scale and pow: (1 + scale/3 * sum of squares over 3 neighbouring
        maps)^0.75. The scale keeps its meaning (a coefficient on the mean square over the window),
        the neighbourhood is across maps instead of across pixels.
      * Input: cuda-convnet subtracts the training set's mean image and does no augmentation in
        this example; mpiasgd's CIFAR-10 pipeline does its own normalisation and random crops and
        flips (mpiasgd.data).
      * The update: cuda-convnet applies the step inside the velocity; the same while lr is constant
        (module docstring); the warm-up and schedules here change lr between steps.
    """
    def conv(cin: int, cout: int, std: float) -> Conv2d:
        return Conv2d(cin, cout, 5, 1, 2, init="normal", std=std, bias_lr_mult=2.0)

    def rnorm() -> LocalResponseNorm:
        return LocalResponseNorm(3, alpha=5e-5, beta=0.75, k=1.0)

    return [
        conv(3, 32, 1e-4), MaxPool2d(3, 2, ceil_mode=True), ReLU(), rnorm(),   # 32x32x32 -> 32x16x16
        conv(32, 32, 0.01), ReLU(), AvgPool2d(3, 2, ceil_mode=True), rnorm(),  # 32x16x16 -> 32x8x8
        conv(32, 64, 0.01), ReLU(), AvgPool2d(3, 2, ceil_mode=True),           # 64x8x8 -> 64x4x4
        Flatten(), Linear(64 * 4 * 4, num_classes, init="normal", std=0.01, decay_mult=250.0, bias_lr_mult=2.0),
    ]


def alexnet_1gpu(num_classes: int = 1000, size: int = 224) -> list[Layer]:
    """The one-tower AlexNet of Krizhevsky 2014, "One weird trick for parallelizing convolutional
    neural networks" (arXiv 1404.5997), as cuda-convnet2's layers/layers-imagenet-1gpu.cfg and
    layer-params-imagenet-1gpu.cfg define it (read from the NervanaSystems/cuda-convnet2 copy); the
    channel widths are those of torchvision's alexnet, which follows the same paper.

    size=224 (input (3, 224, 224)), 61,100,840 parameters with 1000 classes:

        conv1  11x11/4, 64, initW 0.01 (no neuron)         64x55x55
        rnorm1 cmrnorm size 5, scale 1e-4, pow 0.75, minDiv 2
        pool1  max 3/2, then relu                          64x27x27
        conv2  5x5, 192, pad 2, initW 0.01, relu           192x27x27
        rnorm2 cmrnorm as rnorm1
        pool2  max 3/2                                     192x13x13
        conv3  3x3, 384, pad 1, initW 0.03, relu           384x13x13
        conv4  3x3, 256, pad 1, initW 0.03, relu           256x13x13
        conv5  3x3, 256, pad 1, initW 0.03 (no neuron)     256x13x13
        pool3  max 3/2, then relu                          256x6x6
        fc6    9216 -> 4096, initW 0.01, relu, dropout 0.5
        fc7    4096 -> 4096, initW 0.01, relu, dropout 0.5
        fc8    4096 -> num_classes, initW 0.01

    conv 23,296 + 307,392 + 663,936 + 884,992 + 590,080 = 2,469,696; fc 37,752,832 + 16,781,312 +
    (4096 + 1) * num_classes (4,097,000). Pools take cuda-convnet's ceil output size (here it equals
    the floor: 55 -> 27 -> 13 -> 6).

    size=64 (input (3, 64, 64); the `alexnet_1gpu_64` built-in), 40,110,888 parameters with 1000
    classes: the same layers but conv1 is 5x5/2, pad 2 (4,864 parameters), so the maps are
    64x32x32 -> pool 16 -> 192x16x16 -> pool 8 -> 384/256/256x8x8 -> pool 4, and fc6 is
    4096 -> 4096 (256x4x4 inputs). The ceil output size matters here (floor would give 15, 7, 3).

    layer-params-imagenet-1gpu.cfg: epsW dexp[base 0.01; tgtFactor 250; numSteps 4], epsB
    dexp[base 0.02; tgtFactor 10; numSteps 2], momentum 0.9, wc 0.0005 on every weight. So
    bias_lr_mult 2, decay_mult 1 on weights, none on biases. Dropout is `dropout2` (scaled at
    training time, keep 0.5): `Dropout(0.5)`, inverted as well.

    Recommended: --lr 0.01 --weight-decay 0.0005 --momentum 0.9 --batch-size 128 (the paper's) and,
    for the weights' 250x decay in 4 equal steps, --lr-schedule step --lr-gamma 0.2515 (= 250^-1/4)
    with four --lr-milestones spread over the run (the biases' own schedule, 10x in 2 steps, is not
    expressible: their lr_mult is fixed).

    Differs from cuda-convnet2:
      * conv1 at 224: cuda-convnet's output size is ceil((224 - 11) / 4) + 1 = 55, its last window
        hanging 3 pixels past the right and bottom edges (read as zeros). Ours floors, so it takes
        pad 2 on every side (torchvision's choice): 55x55 as well, the windows shifted 2 pixels.
      * Biases: the file starts conv2, conv4, conv5, fc6 and fc7's biases at 1 (initB=1, to start the
        ReLUs active) and fc8's at -7; mpiasgd's Conv2d and Linear start biases at 0 (fc8's -7 has
        no effect anyway: softmax ignores a constant added to every logit).
      * fc7: the 1gpu file in that copy says outputs=8192 under the name [fc4096b]; we follow the
        paper, the layer's name, torchvision and the same repository's 4gpu-data file: 4096.
      * The learning-rate schedule, as above; the update as in the module docstring.

    Raises ValueError for a size other than 224 or 64.
    """
    if size not in ALEXNET_SIZES:
        raise ValueError(f"alexnet_1gpu: size must be one of {', '.join(map(str, ALEXNET_SIZES))}, got {size!r}")

    def conv(cin: int, cout: int, kernel: int, stride: int, pad: int, std: float) -> Conv2d:
        return Conv2d(cin, cout, kernel, stride, pad, init="normal", std=std, bias_lr_mult=2.0)

    def fc(fin: int, fout: int) -> Linear:
        return Linear(fin, fout, init="normal", std=0.01, bias_lr_mult=2.0)

    def rnorm() -> LocalResponseNorm:
        return LocalResponseNorm(5, alpha=1e-4, beta=0.75, k=2.0)

    def pool() -> MaxPool2d:
        return MaxPool2d(3, 2, ceil_mode=True)

    first, last = (conv(3, 64, 11, 4, 2, 0.01), 6) if size == 224 else (conv(3, 64, 5, 2, 2, 0.01), 4)
    return [
        first, rnorm(), pool(), ReLU(),                     # 224: 64x55x55 -> 27 (64: 64x32x32 -> 16)
        conv(64, 192, 5, 1, 2, 0.01), ReLU(), rnorm(), pool(),  # 192x27x27 -> 13 (192x16x16 -> 8)
        conv(192, 384, 3, 1, 1, 0.03), ReLU(),
        conv(384, 256, 3, 1, 1, 0.03), ReLU(),
        conv(256, 256, 3, 1, 1, 0.03), pool(), ReLU(),      # 256x13x13 -> 6 (256x8x8 -> 4)
        Flatten(),
        fc(256 * last * last, 4096), ReLU(), Dropout(0.5),
        fc(4096, 4096), ReLU(), Dropout(0.5),
        fc(4096, num_classes),
    ]
