# lowmem-ft: LoRA fine-tuning with approximate and memory-sharing backpropagation.
#   make            build train_llama (CPU backend; OpenMP)
#   make run        the embedded demo (bundled tiny model and data, no download)
#   make test       the CPU test suite (what CI runs)
#   make bench-cpu  our CPU training step against PyTorch CPU on the same config
CXX      ?= g++
CPU_ARCH ?= native
PYTHON   ?= /usr/bin/python3
CFLAGS   := -O3 -march=$(CPU_ARCH) -fopenmp -Wall -Wextra -Wno-unused-function -Wno-unused-parameter -Wno-vla -std=gnu++17 -x c++
LDLIBS   := -lm -fopenmp
HEADERS  := $(wildcard llmc/*.h llmc/cpu/*.h)
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
ifeq ($(NVCC),)
  $(info make: nvcc not found: CUDA compile checks SKIPPED)
endif
GPU_ARCH ?= 80 90

.PHONY: all run test test-c test-py cuda-compile-check bench-cpu clean

all: train_llama

train_llama: train_llama.cu $(HEADERS)
	$(CXX) $(CFLAGS) $< -o $@ $(LDLIBS)

test/llama_probe: test/llama_probe.cu train_llama.cu $(HEADERS)
	$(CXX) $(CFLAGS) $< -o $@ $(LDLIBS)

test/test_units: test/test_units.cu $(HEADERS)
	$(CXX) $(CFLAGS) $< -o $@ $(LDLIBS)

run: train_llama
	./train_llama --model data/llama_demo --data data/llama_demo_ft_train.bin --val data/llama_demo_ft_val.bin \
	  --mode lowmem --steps 60 --batch 8 --seq 128 --lr 3e-3 --warmup 5 --val-every 20 --lora-rank 8 \
	  --generate 120 --prompt "Licensed under the" --temperature 0.7

# The CUDA toolkit is present on CI machines even without a GPU: make sure every .cu source also
# compiles under nvcc for each GPU_ARCH, so the CUDA backend can be built on GPU machines.
cuda-compile-check:
ifeq ($(NVCC),)
	@echo "cuda-compile-check: nvcc not found, SKIPPED"
else
	@for a in $(GPU_ARCH); do \
	  echo "nvcc -arch=sm_$$a: train_llama.cu"; \
	  $(NVCC) -O2 -arch=sm_$$a -std=c++17 -Xcompiler -fopenmp -Xcompiler -Wall -o build/train_llama_sm$$a train_llama.cu -lgomp || exit 1; \
	done
endif

test: test-c test-py cuda-compile-check

test-c: test/test_units
	./test/test_units

test-py: train_llama test/llama_probe
	$(PYTHON) -m pytest -q test

bench-cpu: train_llama
	bash scripts/bench_cpu.sh

clean:
	rm -rf train_llama test/llama_probe test/test_units build
