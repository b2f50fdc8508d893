"""Which op types ``graphgrad grads`` runs of a saved graph, and which are I/O.

:data:`PURE_OPS` is the allowlist: math, array, nn, random, linear algebra,
string and image compute, control flow (``cond``, ``case``, ``while`` in
both their v1 and functional forms, function calls), variables, their reads
and assigns, TensorArrays, in-memory datasets and iterators, and the
gradient ops TensorFlow builds. It lists no op that touches a file, the
network, another process, or stops the process (``ImmutableConst``,
``RemoteCall``, ``Abort``, ``PyFunc``).
:func:`io_kind` names what a known I/O op does: those run with
``--allow-io``, as does an allowlisted op that names a file in an attr
(:func:`file_attr`). An op in neither list is refused whatever the flags.
"""

import re
from typing import Dict, FrozenSet, Optional, Tuple

# In-memory input pipelines: their functions are checked like any other.
_DATASET_OPS = """
AnonymousIterator AnonymousIteratorV2 AnonymousIteratorV3
AnonymousRandomSeedGenerator AnonymousSeedGenerator BatchDataset
BatchDatasetV2 ConcatenateDataset DatasetCardinality DatasetToSingleElement
DeleteIterator DeleteRandomSeedGenerator DeleteSeedGenerator
DummySeedGenerator ExperimentalMapAndBatchDataset FilterDataset
FlatMapDataset InterleaveDataset Iterator IteratorGetNext
IteratorGetNextAsOptional IteratorGetNextSync IteratorV2 MakeIterator
MapAndBatchDataset MapDataset ModelDataset OneShotIterator OptimizeDataset
OptimizeDatasetV2 OptionsDataset PaddedBatchDataset PaddedBatchDatasetV2
ParallelMapDataset ParallelMapDatasetV2 PrefetchDataset RangeDataset
ReduceDataset RepeatDataset ShuffleAndRepeatDataset
ShuffleAndRepeatDatasetV2 ShuffleDataset ShuffleDatasetV2 ShuffleDatasetV3
SkipDataset TakeDataset TensorDataset TensorSliceDataset ZipDataset
"""

PURE_OPS: FrozenSet[str] = frozenset(_DATASET_OPS.split() + """
Abs AccumulateNV2 Acos Acosh Add AddManySparseToTensorsMap AddN
AddSparseToTensorsMap AddV2 AdjustContrast AdjustContrastv2 AdjustHue
AdjustSaturation All AllCandidateSampler Angle AnonymousHashTable
AnonymousMutableDenseHashTable AnonymousMutableHashTable
AnonymousMutableHashTableOfTensors Any ApproxTopK ApproximateEqual ArgMax
ArgMin AsString Asin Asinh Assert Assign AssignAdd AssignAddVariableOp
AssignSub AssignSubVariableOp AssignVariableOp Atan Atan2 Atanh AvgPool
AvgPool3D AvgPool3DGrad AvgPoolGrad BandedTriangularSolve BatchCholesky
BatchCholeskyGrad BatchFFT BatchFFT2D BatchFFT3D BatchIFFT BatchIFFT2D
BatchIFFT3D BatchMatMul BatchMatMulV2 BatchMatMulV3 BatchMatrixBandPart
BatchMatrixDeterminant BatchMatrixDiag BatchMatrixDiagPart
BatchMatrixInverse BatchMatrixSetDiag BatchMatrixSolve BatchMatrixSolveLs
BatchMatrixTriangularSolve BatchNormWithGlobalNormalization
BatchNormWithGlobalNormalizationGrad BatchSelfAdjointEig
BatchSelfAdjointEigV2 BatchSvd BatchToSpace BatchToSpaceND BesselI0
BesselI0e BesselI1 BesselI1e BesselJ0 BesselJ1 BesselK0 BesselK0e BesselK1
BesselK1e BesselY0 BesselY1 Betainc BiasAdd BiasAddGrad BiasAddV1 Bincount
Bitcast BitwiseAnd BitwiseOr BitwiseXor BlockLSTM BlockLSTMGrad
BlockLSTMGradV2 BlockLSTMV2 BroadcastArgs BroadcastGradientArgs
BroadcastTo Bucketize CTCBeamSearchDecoder CTCGreedyDecoder CTCLoss
CTCLossV2 Case Cast Ceil CheckNumerics CheckNumericsV2 Cholesky
CholeskyGrad ClipByValue CombinedNonMaxSuppression Complex ComplexAbs
ComputeAccidentalHits Concat ConcatOffset ConcatV2 Conj ConjugateTranspose
Const ConsumeMutexLock ControlTrigger Conv Conv2D Conv2DBackpropFilter
Conv2DBackpropFilterV2 Conv2DBackpropInput Conv2DBackpropInputV2 Conv3D
Conv3DBackpropFilter Conv3DBackpropFilterV2 Conv3DBackpropInput
Conv3DBackpropInputV2 Cos Cosh CountUpTo CropAndResize
CropAndResizeGradBoxes CropAndResizeGradImage Cross Cumprod Cumsum
CumulativeLogsumexp DataFormatDimMap DataFormatVecPermute Dawsn
DebugGradientIdentity DebugGradientRefIdentity DecodeAndCropJpeg
DecodeBase64 DecodeBmp DecodeCSV DecodeCompressed DecodeGif DecodeImage
DecodeJSONExample DecodeJpeg DecodeJxl DecodePaddedRaw DecodePng DecodeRaw
DecodeWebP DeepCopy DenseBincount DenseToDenseSetOperation
DenseToSparseSetOperation DepthToSpace DepthwiseConv2dNative
DepthwiseConv2dNativeBackpropFilter DepthwiseConv2dNativeBackpropInput
Dequantize DeserializeManySparse DeserializeSparse DestroyResourceOp
DestroyTemporaryVariable DeviceIndex Diag DiagPart Digamma Dilation2D
Dilation2DBackpropFilter Dilation2DBackpropInput DisableCopyOnRead Div
DivNoNan DrawBoundingBoxes DrawBoundingBoxesV2 DynamicPartition
DynamicStitch EditDistance Eig Einsum Elu EluGrad Empty EmptyTensorList
EmptyTensorMap EncodeBase64 EncodeJpeg EncodeJpegVariableQuality EncodePng
EnsureShape Enter Equal Erf Erfc Erfinv EuclideanNorm Exit Exp ExpandDims
Expint Expm1 ExtractGlimpse ExtractGlimpseV2 ExtractImagePatches
ExtractJpegShape ExtractVolumePatches FFT FFT2D FFT3D FFTND FakeParam
FakeQuantWithMinMaxArgs FakeQuantWithMinMaxArgsGradient
FakeQuantWithMinMaxVars FakeQuantWithMinMaxVarsGradient
FakeQuantWithMinMaxVarsPerChannel
FakeQuantWithMinMaxVarsPerChannelGradient Fill Fingerprint
FixedUnigramCandidateSampler Floor FloorDiv FloorMod For FractionalAvgPool
FractionalAvgPoolGrad FractionalMaxPool FractionalMaxPoolGrad FresnelCos
FresnelSin FusedBatchNorm FusedBatchNormGrad FusedBatchNormGradV2
FusedBatchNormGradV3 FusedBatchNormV2 FusedBatchNormV3 FusedPadConv2D
FusedResizeAndPadConv2D GRUBlockCell GRUBlockCellGrad Gather GatherNd
GatherV2 GenerateBoundingBoxProposals Greater GreaterEqual GuaranteeConst
HSVToRGB HashTable HashTableV2 HistogramFixedWidth IFFT IFFT2D IFFT3D
IFFTND IRFFT IRFFT2D IRFFT3D IRFFTND Identity IdentityN If Igamma
IgammaGradA Igammac Imag ImageProjectiveTransformV2
ImageProjectiveTransformV3 InTopK InTopKV2 InitializeTable
InitializeTableV2 InplaceAdd InplaceSub InplaceUpdate Inv InvGrad Invert
InvertPermutation IsFinite IsInf IsNan IsVariableInitialized
IsotonicRegression L2Loss LRN LRNGrad LSTMBlockCell LSTMBlockCellGrad
LeakyRelu LeakyReluGrad LearnedUnigramCandidateSampler LeftShift Less
LessEqual Lgamma LinSpace ListDiff Log Log1p LogMatrixDeterminant
LogSoftmax LogUniformCandidateSampler LogicalAnd LogicalNot LogicalOr
LookupTableExport LookupTableExportV2 LookupTableFind LookupTableFindV2
LookupTableImport LookupTableImportV2 LookupTableInsert
LookupTableInsertV2 LookupTableRemoveV2 LookupTableSize LookupTableSizeV2
LoopCond LowerBound Lu MatMul MatrixBandPart MatrixDeterminant MatrixDiag
MatrixDiagPart MatrixDiagPartV2 MatrixDiagPartV3 MatrixDiagV2 MatrixDiagV3
MatrixExponential MatrixInverse MatrixLogarithm MatrixSetDiag
MatrixSetDiagV2 MatrixSetDiagV3 MatrixSolve MatrixSolveLs MatrixSquareRoot
MatrixTriangularSolve Max MaxPool MaxPool3D MaxPool3DGrad
MaxPool3DGradGrad MaxPoolGrad MaxPoolGradGrad MaxPoolGradGradV2
MaxPoolGradGradWithArgmax MaxPoolGradV2 MaxPoolGradWithArgmax MaxPoolV2
MaxPoolWithArgmax Maximum Mean Merge Min Minimum MirrorPad MirrorPadGrad
Mod Mul MulNoNan Multinomial MutableDenseHashTable MutableDenseHashTableV2
MutableHashTable MutableHashTableOfTensors MutableHashTableOfTensorsV2
MutableHashTableV2 MutexLock MutexV2 Ndtri Neg NextAfter NextIteration
NoOp NonDeterministicInts NonMaxSuppression NonMaxSuppressionV2
NonMaxSuppressionV3 NonMaxSuppressionV4 NonMaxSuppressionV5
NonMaxSuppressionWithOverlaps NotEqual NthElement OneHot OnesLike
OptionalFromValue OptionalGetValue OptionalHasValue OptionalNone Pack Pad
PadV2 ParallelConcat ParallelDynamicStitch ParameterizedTruncatedNormal
ParseExample ParseExampleV2 ParseSequenceExample ParseSequenceExampleV2
ParseSingleExample ParseSingleSequenceExample ParseTensor PartitionedCall
Placeholder PlaceholderV2 PlaceholderWithDefault Polygamma PopulationCount
Pow PreventGradient Prod Qr QuantizeAndDequantize QuantizeAndDequantizeV2
QuantizeAndDequantizeV3 QuantizeAndDequantizeV4
QuantizeAndDequantizeV4Grad QuantizeDownAndShrinkRange QuantizeV2
QuantizedAdd QuantizedAvgPool QuantizedBatchNormWithGlobalNormalization
QuantizedBiasAdd QuantizedConcat QuantizedConv2D QuantizedConv2DAndRelu
QuantizedConv2DAndReluAndRequantize QuantizedConv2DAndRequantize
QuantizedConv2DPerChannel QuantizedConv2DWithBias
QuantizedConv2DWithBiasAndRelu QuantizedConv2DWithBiasAndReluAndRequantize
QuantizedConv2DWithBiasAndRequantize
QuantizedConv2DWithBiasSignedSumAndReluAndRequantize
QuantizedConv2DWithBiasSumAndRelu
QuantizedConv2DWithBiasSumAndReluAndRequantize QuantizedDepthwiseConv2D
QuantizedDepthwiseConv2DWithBias QuantizedDepthwiseConv2DWithBiasAndRelu
QuantizedDepthwiseConv2DWithBiasAndReluAndRequantize QuantizedInstanceNorm
QuantizedMatMul QuantizedMatMulWithBias
QuantizedMatMulWithBiasAndDequantize QuantizedMatMulWithBiasAndRelu
QuantizedMatMulWithBiasAndReluAndRequantize
QuantizedMatMulWithBiasAndRequantize QuantizedMaxPool QuantizedMul
QuantizedRelu QuantizedRelu6 QuantizedReluX QuantizedReshape
QuantizedResizeBilinear RFFT RFFT2D RFFT3D RFFTND RGBToHSV RaggedBincount
RaggedCross RaggedFillEmptyRows RaggedFillEmptyRowsGrad RaggedGather
RaggedRange RaggedTensorFromVariant RaggedTensorToSparse
RaggedTensorToTensor RaggedTensorToVariant RaggedTensorToVariantGradient
RandomCrop RandomGamma RandomGammaGrad RandomIndexShuffle RandomPoisson
RandomPoissonV2 RandomShuffle RandomStandardNormal RandomUniform
RandomUniformInt Range Rank ReadVariableOp Real RealDiv Reciprocal
ReciprocalGrad ReduceJoin RefEnter RefExit RefIdentity RefMerge
RefNextIteration RefSelect RefSwitch RegexFullMatch RegexReplace Relu
Relu6 Relu6Grad ReluGrad RequantizationRange RequantizationRangePerChannel
Requantize RequantizePerChannel Reshape ResizeArea ResizeBicubic
ResizeBicubicGrad ResizeBilinear ResizeBilinearGrad ResizeNearestNeighbor
ResizeNearestNeighborGrad ResourceCountUpTo ResourceGather
ResourceGatherNd ResourceScatterAdd ResourceScatterDiv ResourceScatterMax
ResourceScatterMin ResourceScatterMul ResourceScatterNdAdd
ResourceScatterNdMax ResourceScatterNdMin ResourceScatterNdSub
ResourceScatterNdUpdate ResourceScatterSub ResourceScatterUpdate
ResourceStridedSliceAssign Reverse ReverseSequence ReverseV2 RightShift
Rint RngReadAndSkip RngSkip Roll Round Rsqrt RsqrtGrad
SampleDistortedBoundingBox SampleDistortedBoundingBoxV2 ScaleAndTranslate
ScaleAndTranslateGrad ScatterAdd ScatterDiv ScatterMax ScatterMin
ScatterMul ScatterNd ScatterNdAdd ScatterNdMax ScatterNdMin
ScatterNdNonAliasingAdd ScatterNdSub ScatterNdUpdate ScatterSub
ScatterUpdate SegmentMax SegmentMaxV2 SegmentMean SegmentMin SegmentMinV2
SegmentProd SegmentProdV2 SegmentSum SegmentSumV2 Select SelectV2
SelfAdjointEig SelfAdjointEigV2 Selu SeluGrad SerializeManySparse
SerializeSparse SerializeTensor SetSize Shape ShapeN Sigmoid SigmoidGrad
Sign Sin Sinh Size Slice Snapshot SobolSample Softmax
SoftmaxCrossEntropyWithLogits Softplus SoftplusGrad Softsign SoftsignGrad
SpaceToBatch SpaceToBatchND SpaceToDepth SparseAdd SparseAddGrad
SparseBincount SparseConcat SparseCross SparseCrossHashed SparseCrossV2
SparseDenseCwiseAdd SparseDenseCwiseDiv SparseDenseCwiseMul
SparseFillEmptyRows SparseFillEmptyRowsGrad SparseMatMul SparseReduceMax
SparseReduceMaxSparse SparseReduceSum SparseReduceSumSparse SparseReorder
SparseReshape SparseSegmentMean SparseSegmentMeanGrad
SparseSegmentMeanGradV2 SparseSegmentMeanWithNumSegments
SparseSegmentSqrtN SparseSegmentSqrtNGrad SparseSegmentSqrtNGradV2
SparseSegmentSqrtNWithNumSegments SparseSegmentSum SparseSegmentSumGrad
SparseSegmentSumGradV2 SparseSegmentSumWithNumSegments SparseSlice
SparseSliceGrad SparseSoftmax SparseSoftmaxCrossEntropyWithLogits
SparseSparseMaximum SparseSparseMinimum SparseSplit SparseTensorDenseAdd
SparseTensorDenseMatMul SparseToDense SparseToSparseSetOperation Spence
Split SplitV Sqrt SqrtGrad Square SquaredDifference Squeeze Stack
StackClose StackCloseV2 StackPop StackPopV2 StackPush StackPushV2 StackV2
StatefulPartitionedCall StatefulRandomBinomial StatefulStandardNormal
StatefulStandardNormalV2 StatefulTruncatedNormal StatefulUniform
StatefulUniformFullInt StatefulUniformInt StatelessCase StatelessIf
StatelessMultinomial StatelessParameterizedTruncatedNormal
StatelessRandomBinomial StatelessRandomGammaV2 StatelessRandomGammaV3
StatelessRandomGetAlg StatelessRandomGetKeyCounter
StatelessRandomGetKeyCounterAlg StatelessRandomNormal
StatelessRandomNormalV2 StatelessRandomPoisson StatelessRandomUniform
StatelessRandomUniformFullInt StatelessRandomUniformFullIntV2
StatelessRandomUniformInt StatelessRandomUniformIntV2
StatelessRandomUniformV2 StatelessSampleDistortedBoundingBox
StatelessShuffle StatelessTruncatedNormal StatelessTruncatedNormalV2
StatelessWhile StaticRegexFullMatch StaticRegexReplace StopGradient
StridedSlice StridedSliceAssign StridedSliceGrad StringFormat StringJoin
StringLength StringLower StringNGrams StringSplit StringSplitV2
StringStrip StringToHashBucket StringToHashBucketFast
StringToHashBucketStrong StringToNumber StringUpper Sub Substr Sum Svd
Switch SymbolicGradient TakeManySparseFromTensorsMap Tan Tanh TanhGrad
TemporaryVariable TensorArray TensorArrayClose TensorArrayCloseV2
TensorArrayCloseV3 TensorArrayConcat TensorArrayConcatV2
TensorArrayConcatV3 TensorArrayGather TensorArrayGatherV2
TensorArrayGatherV3 TensorArrayGrad TensorArrayGradV2 TensorArrayGradV3
TensorArrayGradWithShape TensorArrayPack TensorArrayRead TensorArrayReadV2
TensorArrayReadV3 TensorArrayScatter TensorArrayScatterV2
TensorArrayScatterV3 TensorArraySize TensorArraySizeV2 TensorArraySizeV3
TensorArraySplit TensorArraySplitV2 TensorArraySplitV3 TensorArrayUnpack
TensorArrayV2 TensorArrayV3 TensorArrayWrite TensorArrayWriteV2
TensorArrayWriteV3 TensorListConcat TensorListConcatLists
TensorListConcatV2 TensorListElementShape TensorListFromTensor
TensorListGather TensorListGetItem TensorListLength TensorListPopBack
TensorListPushBack TensorListPushBackBatch TensorListReserve
TensorListResize TensorListScatter TensorListScatterIntoExistingList
TensorListScatterV2 TensorListSetItem TensorListSplit TensorListStack
TensorMapErase TensorMapHasKey TensorMapInsert TensorMapLookup
TensorMapSize TensorMapStackKeys TensorScatterAdd TensorScatterMax
TensorScatterMin TensorScatterSub TensorScatterUpdate
TensorStridedSliceUpdate ThreadUnsafeUnigramCandidateSampler Tile TileGrad
Timestamp ToBool TopK TopKV2 Transpose TridiagonalMatMul TridiagonalSolve
TruncateDiv TruncateMod TruncatedNormal UnicodeDecode
UnicodeDecodeWithOffsets UnicodeEncode UnicodeScript UnicodeTranscode
UniformCandidateSampler Unique UniqueV2 UniqueWithCounts
UniqueWithCountsV2 Unpack UnravelIndex UnsortedSegmentJoin
UnsortedSegmentMax UnsortedSegmentMin UnsortedSegmentProd
UnsortedSegmentSum UpperBound VarHandleOp VarIsInitializedOp Variable
VariableShape VariableV2 Where While Xdivy Xlog1py Xlogy ZerosLike Zeta
""".split())

# What each known I/O op does, and the op types that do it.
_IO_GROUPS: Dict[str, Tuple[str, ...]] = {
    "writes a file": (
        "WriteFile", "DatasetToTFRecord", "ExperimentalDatasetToTFRecord"),
    "reads a file": ("ReadFile",),
    "lists files": ("MatchingFiles",),
    "reads a file (memory-mapped)": ("ImmutableConst",),
    "reads a file (a lookup table's)": (
        "InitializeTableFromTextFile", "InitializeTableFromTextFileV2"),
    "saves a checkpoint": ("SaveV2", "Save", "SaveSlices"),
    "writes a checkpoint": ("MergeV2Checkpoints",),
    "restores a checkpoint": ("RestoreV2", "Restore", "RestoreSlice"),
    "prints": ("PrintV2", "Print"),
    "reads files": (
        "TFRecordDataset", "TFRecordDatasetV2", "TextLineDataset",
        "FixedLengthRecordDataset", "FixedLengthRecordDatasetV2", "CSVDataset",
        "CSVDatasetV2", "ExperimentalCSVDataset", "LMDBDataset",
        "ExperimentalLMDBDataset", "SqlDataset", "ExperimentalSqlDataset",
        "LoadDataset", "ExperimentalLoadDataset"),
    "writes files": ("SaveDataset", "SaveDatasetV2"),
    "may cache to a file": ("CacheDataset", "CacheDatasetV2"),
    "writes a snapshot to files": ("SnapshotDataset", "SnapshotDatasetV2"),
    "reads a snapshot's files": (
        "SnapshotDatasetReader", "SnapshotNestedDatasetReader"),
    "writes debug dumps to its debug URLs": (
        "DebugIdentity", "DebugIdentityV2", "DebugIdentityV3", "DebugNanCount",
        "DebugNumericSummary", "DebugNumericSummaryV2", "Copy", "CopyHost"),
    "writes a summary": ("ImportEvent",),
}
_IO_TYPES: Dict[str, str] = {
    name: kind for kind, names in _IO_GROUPS.items() for name in names}
PIPELINE = "runs an input pipeline"
# (starts with, ends with, what it does), for the op families.
_IO_PREFIXES = (("Write", "Summary", "writes a summary"),
                ("", "Summary", "writes a summary"),
                ("", "SummaryV2", "writes a summary"),
                ("", "SummaryWriter", "writes a summary"),
                ("CreateSummary", "", "writes a summary"),
                ("", "ReaderV2", "reads files"), ("", "Reader", "reads files"),
                ("Reader", "", "reads files"),
                ("", "Iterator", PIPELINE),
                ("", "IteratorV2", PIPELINE),
                ("", "IteratorV3", PIPELINE),
                ("Iterator", "", PIPELINE),
                ("MakeIterator", "", PIPELINE),
                ("DeleteIterator", "", PIPELINE),
                ("DatasetTo", "", PIPELINE),
                ("DatasetCardinality", "", PIPELINE),
                ("OptimizeDataset", "", PIPELINE))
# Input-pipeline ops that are refused even with --allow-io: one runs a
# serialized graph that is not checked, the others talk to a server.
_NEVER = ("DatasetFromGraph", "DataServiceDataset", "RegisterDataset")


def io_kind(op_type: str) -> Optional[str]:
  """What a known I/O op of ``op_type`` does outside the process, or ``None``.

  Example:
    >>> io_kind("WriteFile"), io_kind("WriteScalarSummary"), io_kind("MatMul")
    ('writes a file', 'writes a summary', None)
  """
  if op_type in _IO_TYPES:
    return _IO_TYPES[op_type]
  if op_type in PURE_OPS or op_type.startswith(_NEVER):
    return None
  for head, tail, kind in _IO_PREFIXES:
    if op_type.startswith(head) and op_type.endswith(tail):
      return kind
  if re.search(r"Dataset(V\d+)?$", op_type):
    return PIPELINE
  return None


def is_pure(op_type: str) -> bool:
  """Whether ``op_type`` is on the allowlist: ``grads`` runs an op of it
  without ``--allow-io``, unless :func:`file_attr` finds that it names a
  file.

  Example:
    >>> is_pure("MatMul"), is_pure("WriteFile"), is_pure("RemoteCall")
    (True, False, False)
  """
  return op_type in PURE_OPS


# An attr whose name says it names a file or another location.
_LOCATION = re.compile(r"file|path|dir|url|uri|source|stream|location")
# Attrs of allowlisted ops that _LOCATION matches but that name something in
# memory: a TensorArray gradient's ``source`` is the name tf.gradients keys
# the gradient TensorArray by.
IN_MEMORY_ATTRS: FrozenSet[Tuple[str, str]] = frozenset(
    (op_type, "source") for op_type in (
        "TensorArrayGrad", "TensorArrayGradV2", "TensorArrayGradV3",
        "TensorArrayGradWithShape"))


def file_attr(node_def) -> Optional[str]:
  """The attr by which the op of ``node_def`` names a file it opens, or
  ``None``.

  An allowlisted op computes in memory, but a few take the name of a file
  in an attr: ``FixedUnigramCandidateSampler`` reads its ``vocab_file``.
  Such an op is I/O, found by structure rather than by name: an attr whose
  name says it names a file or another location (file, path, dir, url,
  uri, source, stream, location) and that holds a name, or a placeholder
  its caller fills in (in a function's body). Attrs whose names start with
  ``_`` are TensorFlow's bookkeeping, not the op's; :data:`IN_MEMORY_ATTRS`
  name nothing outside the process. The attrs the op's registered OpDef
  leaves out hold its defaults, which for every such attr of an
  allowlisted op name nothing (tests/cli/test_grads_untrusted.py lists
  them all, so a TensorFlow that adds one shows up).

  Example:
    >>> from tensorflow.core.framework import node_def_pb2
    >>> node = node_def_pb2.NodeDef(op="FixedUnigramCandidateSampler")
    >>> file_attr(node) is None
    True
    >>> node.attr["vocab_file"].s = b"/dev/zero"
    >>> file_attr(node)
    'vocab_file'
  """
  for key in sorted(node_def.attr):
    if (key.startswith("_") or not _LOCATION.search(key)
        or (node_def.op, key) in IN_MEMORY_ATTRS):
      continue
    value = node_def.attr[key]
    if value.placeholder or value.s or any(value.list.s):
      return key
  return None
