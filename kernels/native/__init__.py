"""The native library's plumbing, shared by every op's cpu form: the CPU probe (isa.py), the
build of all kernels into one library of torch operators per level (build.py; the op folders'
.cpp sources with kernels.h and simd.h here), their registration (ops.cpp, ops_namespace.cpp)
and fakes (ops.py)."""
