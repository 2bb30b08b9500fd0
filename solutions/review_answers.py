"""Chapter 11's reference answers: each written as the reasoning that gives it.

The review notebook ships its answers blank; ``EDU3D_SOLUTIONS=1`` (CI, the instructor)
grades these instead (:func:`edu3d.course.ch11_review.reference`). Read one only after
trying the question: the notebook's check reveals the reasoning once you pass.
"""

ANSWERS = {}

# q1
q1 = 2 * (8 - 1) / 8 * 1.0  # reduce-scatter + all-gather, N-1 chunks of S/N each
ANSWERS["ring"] = q1

# q2
q2 = "b"
ANSWERS["dp_when"] = q2

# q3
q3 = {0: 120.0, 1: 31.4, 2: 16.6, 3: 1.9}  # 16Ψ, 4Ψ + 12Ψ/N, 2Ψ + 14Ψ/N, 16Ψ/N
ANSWERS["zero_gb"] = q3

# q4
q4 = {1: {"optimizer"}, 2: {"optimizer", "grads"}, 3: {"optimizer", "grads", "params"}}
ANSWERS["zero_shards"] = q4

# q5
q5 = 3 / 2  # 3Ψ against 2Ψ
ANSWERS["zero_traffic"] = q5

# q6
q6 = 16 * 6.74e9 / 1e9  # 2 + 2 + 12 bytes per parameter
ANSWERS["state_16psi"] = q6

# q7
sbh, core = 2048 * 1 * 12288, 5 * 96 * 2048 / 12288  # bytes per unit, 5as/h = 80
q7 = {"none": sbh * (34 + core) / 1e6, "tp": sbh * (10 + 24 / 8 + core / 8) / 1e6,
      "tp+sp": sbh / 8 * (34 + core) / 1e6}
ANSWERS["activations"] = q7

# q8
core = 5 * 32 * 4096 / 4096  # 5as/h, in units of sbh
q8 = core / (10 + 8 + 8 * 11008 / 4096 + core)  # SwiGLU keeps 8sbf, not 16sbh
ANSWERS["selective"] = q8

# q9
q9 = 4
ANSWERS["tp_comm"] = q9

# q10
q10 = (4 - 1) / (8 + 4 - 1)
ANSWERS["bubble_1f1b"] = q10

# q11
q11 = (4 - 1) / (2 * 8 + 4 - 1)
ANSWERS["bubble_interleaved"] = q11

# q12
q12 = (3 / (24 + 3)) / (9 / (24 + 9))  # idle 3(F+B-2W) = 3 vs 3(F+B) = 9, busy 8 x 3
ANSWERS["zb_ratio"] = q12

# q13
q13 = {"gpipe": 8, "1f1b": 4}
ANSWERS["in_flight"] = q13

# q14
q14 = 9 * (8 - 1)  # (p-1)/(m+p-1) <= 0.1  <=>  m >= 9(p-1)
ANSWERS["microbatches"] = q14

# q15
q15 = False
ANSWERS["fits"] = q15

# q16
q16 = {"dp": 8, "tp": 1, "pp": 2}
ANSWERS["layout"] = q16
