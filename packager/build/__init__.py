"""``edgepack build``: import -> calibrate -> sensitivity -> search -> quantize -> write.

One module per phase:

1. **import** (:mod:`.source`) the source (safetensors, HF folder, GGUF, or an existing
   float ``.epk``) as float32 tensors; when calibration needs the runtime, the float
   reference is a float32 package the runtime opens once (float activations, float KV
   cache, numpy kernels): in RAM when it fits, on disk only when the float model does not
   fit in memory (:func:`.source.float_dir`); a float ``.epk`` source is used as it is;
2. **calibrate** (:mod:`.calibrate`): tokenize the calibration text, cut mixed-length
   samples and stream them through the runtime's float path;
3. **sensitivity** of every tensor to every candidate encoding (:mod:`..sensitivity`),
   low-rank factorizations as further candidates when enabled (:mod:`..factorize`); with
   GPTQ, the error it saves over RTN is measured per tensor kind and encoding on a few
   layers (:mod:`.measure`); a probe rescales every tensor kind by its measured KL;
4. **search** the assignment meeting the size (and latency) budget (:mod:`..search`,
   budgets from :mod:`.budget`);
5. **scale** (SmoothQuant, AWQ) for the chosen encodings, folded into the previous ops
   (:mod:`.scale`);
6. **quantize** each tensor with its chosen encoding (GPTQ or RTN, bit-exact with the
   decoders) and measure the real output error (:mod:`.quantize`); the package's exact
   size is laid out from the plan (:mod:`.write`): above the size target, the budget is
   tightened and only the tensors whose choice changed are redone, nothing written; then
   the package is **written** once, with a precision-plan section (:mod:`.plan_doc`) and
   a calibration-report section;
7. **verify**: the whole plan's KL on the probe tokens, predicted vs measured
   (:mod:`.verify`), and the report (:mod:`..report`).

Phases report progress through a :class:`Progress` object (the CLI draws rich bars);
:class:`BuildResult` carries the summary, timings and peak memory.
"""

from .pipeline import BuildOutputError, build
from .result import BuildResult, Progress

__all__ = ["BuildOutputError", "BuildResult", "Progress", "build"]
