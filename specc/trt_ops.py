"""TensorRT's ONNX parser: which operators it reads, for which tensor types, with which restrictions.

Transcribed by hand on 2026-12-01 from the operator support matrix of onnx-tensorrt
(`docs/operators.md`, the TensorRT 10.15 text: "TensorRT 10.15 supports operators in the
inclusive range of opset 9 to opset 24"). The restrictions are kept as written there; the lint
(specc/trt_lint.py) checks the ones a specc graph can break. Update both together when moving to a
newer TensorRT, and change TRT_VERSION.
"""
TRT_VERSION = "10.15"
SOURCE = "onnx/onnx-tensorrt docs/operators.md (TensorRT 10.15)"
OPSETS = (9, 24)

_F = "FP32 FP16 BF16"
_F2 = "FP32 FP16"
_N = _F + " INT32 INT64"
_A = _N + " BOOL"

# operator -> (tensor types it runs, restriction as documented or "")
SUPPORTED: dict[str, tuple[str, str]] = {
    "Abs": (_N, ""), "Acos": (_F, ""), "Acosh": (_F, ""), "Add": (_N, ""), "And": ("BOOL", ""),
    "ArgMax": (_N, ""), "ArgMin": (_N, ""), "Asin": (_F, ""), "Asinh": (_F, ""), "Atan": (_F, ""),
    "Atanh": (_F, ""),
    "Attention": (_F + " INT8 FP8", "Q, K, V and attn_mask must be 4D; past_key, past_value and nonpad_kv_seqlen "
                  "inputs, present_key, present_value and qk_matmul_output outputs, qk_matmul_output_mode and "
                  "softcap attributes are unsupported"),
    "AveragePool": (_F, "2D or 3D pooling only; dilations empty or all ones"),
    "BatchNormalization": (_F, ""), "BlackmanWindow": (_F2, ""),
    "Cast": (_N + " UINT8 BOOL", ""), "CastLike": (_N + " UINT8 BOOL", ""),
    "Ceil": (_F, ""), "Celu": (_F, ""), "Clip": (_F, ""), "Concat": (_A, ""),
    "Constant": (_F + " FP8 FP4 INT4 INT32 INT64 BOOL", "sparse_value, value_string and value_strings unsupported"),
    "ConstantOfShape": (_F + " FP8 FP4 INT4 INT32 INT64 BOOL", ""),
    "Conv": (_F, ""), "ConvTranspose": (_F, ""), "Cos": (_F, ""), "Cosh": (_F, ""),
    "CumSum": (_F, "axis must be a build-time constant"),
    "DeformConv": (_F2, "input with 1D or 2D spatial dimensions; equal begin/end pads"),
    "DepthToSpace": (_N, ""), "DequantizeLinear": ("INT8 FP8 FP4 INT4", "x_zero_point must be zero"),
    "Div": (_N, ""), "Dropout": (_F, "is_training must be an initializer and False"),
    "Einsum": (_F, ""), "Elu": (_F, ""), "Equal": (_N, ""), "Erf": (_F, ""), "Exp": (_F, ""),
    "Expand": (_A, ""), "EyeLike": (_A, "input must have static dimensions"), "Flatten": (_A, ""),
    "Floor": (_F, ""), "Gather": (_A, ""), "GatherElements": (_A, ""), "GatherND": (_A, ""),
    "Gelu": (_F + " INT8 INT32 INT64", ""), "Gemm": (_F, ""), "GlobalAveragePool": (_F, ""),
    "GlobalLpPool": (_F, ""), "GlobalMaxPool": (_F, ""), "Greater": (_N, ""), "GreaterOrEqual": (_N, ""),
    "GridSample": (_F2, "input must be 4D"), "GroupNormalization": (_F, ""),
    "GRU": (_F, "bidirectional: the same activations both ways"), "HammingWindow": (_F2, ""),
    "HannWindow": (_F2, ""), "HardSigmoid": (_F, ""), "HardSwish": (_F, ""),
    "Hardmax": (_F, "axis dimension must be a build-time constant"), "Identity": (_A, ""),
    "If": (_A, "both branches' outputs of the same rank, with different names"), "ImageScaler": (_F, ""),
    "InstanceNormalization": (_F, ""), "IsInf": (_F, ""), "IsNaN": (_N, ""),
    "LayerNormalization": (_F, "only the first output Y"), "LeakyRelu": (_F, ""), "Less": (_N, ""),
    "LessOrEqual": (_N, ""), "Log": (_F, ""), "LogSoftmax": (_F, ""),
    "Loop": (_A, "scan output length cannot be dynamic; carried shapes fixed across iterations"),
    "LRN": (_F, ""), "LSTM": (_F, "bidirectional: the same activations both ways; input_forget 0; layout 0"),
    "LpNormalization": (_F, ""), "LpPool": (_F, "dilations empty or all ones"), "MatMul": (_F, ""),
    "Max": (_N, ""), "MaxPool": (_F, "2D or 3D pooling only; no Indices output; dilations empty or all ones"),
    "Mean": (_F + " FP8 INT32 INT64", ""), "MeanVarianceNormalization": (_F, ""), "Min": (_N, ""),
    "Mish": (_F2, ""), "Mod": (_N, ""), "Mul": (_N, ""), "Neg": (_N, ""), "NonMaxSuppression": (_F2, ""),
    "NonZero": (_F2, ""), "Not": ("BOOL", ""), "OneHot": (_A, "depth must be a build-time constant"),
    "Or": ("BOOL", ""), "Pad": (_N, ""), "ParametricSoftplus": (_F, ""), "Pow": (_N, ""), "PRelu": (_F, ""),
    "QuantizeLinear": (_F, "y_zero_point must be 0"),
    "RandomNormal": (_F, "seed ignored"), "RandomNormalLike": (_F, "seed ignored"),
    "RandomUniform": (_F, "seed ignored"), "RandomUniformLike": (_F, "seed ignored"),
    "Range": (_N, ""), "Reciprocal": (_F, ""),
    **{f"Reduce{r}": (_N, "axes must be an initializer")
       for r in ("L1", "L2", "LogSum", "LogSumExp", "Max", "Mean", "Min", "Prod", "Sum", "SumSquare")},
    "Relu": (_N, ""), "Reshape": (_A, ""),
    "Resize": (_F, "modes half_pixel, pytorch_half_pixel, tf_half_pixel_for_nn, asymmetric, align_corners; "
                   "nearest or linear; no antialiasing"),
    "ReverseSequence": (_A, ""), "RMSNormalization": (_F, ""),
    "RNN": (_F, "bidirectional: the same activations both ways"), "RoiAlign": (_F2, ""),
    "RotaryEmbedding": (_F, "position_ids must be INT64"), "Round": (_F, ""),
    "STFT": ("FP32", "frame_step and window initializers; real input"), "ScaledTanh": (_F, ""), "Scan": (_F, ""),
    "Scatter": (_N, ""), "ScatterElements": (_N, ""),
    "ScatterND": (_N, "reduction other than none is not supported"), "Selu": (_F, ""), "Shape": (_A, ""),
    "Shrink": (_N, ""), "Sigmoid": (_F, ""), "Sign": (_N, ""), "Sin": (_F, ""), "Sinh": (_F, ""),
    "Size": (_A, ""), "Slice": (_A, ""), "Softmax": (_F, ""), "Softplus": (_F, ""), "Softsign": (_F, ""),
    "SpaceToDepth": (_N, ""), "Split": (_A, ""), "Sqrt": (_F, ""),
    "Squeeze": (_A, "axes must be resolvable to a constant"), "Sub": (_N, ""), "Sum": (_N, ""),
    "Tan": (_F, ""), "Tanh": (_F, ""),
    "TensorScatter": (_F + " INT32", "past_cache and update must be 4D; axis must be -2"),
    "ThresholdedRelu": (_F, ""), "Tile": (_A, ""),
    "TopK": (_N, "sorted must be 1; K must be less than 3840"), "Transpose": (_A, ""), "Trilu": (_A, ""),
    "Unsqueeze": (_A, "axes must be resolvable to a constant"), "Upsample": (_F, ""), "Where": (_A, ""),
    "Xor": ("BOOL", ""),
}

# Listed as unsupported ("N") in the same table.
UNSUPPORTED = frozenset("""
AffineGrid Bernoulli BitShift BitwiseAnd BitwiseNot BitwiseOr BitwiseXor Col2Im CenterCropPad Compress
ConcatFromSequence ConvInteger DFT Det DynamicQuantizeLinear ImageDecoder MatMulInteger MaxRoiPool MaxUnpool
MelWeightMatrix Multinomial NegativeLogLikelihoodLoss Optional OptionalGetElement OptionalHasElement
QLinearConv QLinearMatMul RegexFullMatch SequenceAt SequenceConstruct SequenceEmpty SequenceErase
SequenceInsert SequenceLength SequenceMap SoftmaxCrossEntropyLoss SplitToSequence StringConcat
StringNormalizer StringSplit TfIdfVectorizer Unique
""".split())

TOPK_MAX = 3839  # "K input must be less than 3840"
