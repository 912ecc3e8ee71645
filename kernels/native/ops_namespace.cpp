// The op namespace of one library of the native kernels (build.py passes it as HYBRID_ENGINE_OPS),
// apart from ops.cpp so that ops.cpp's object, the slow one to compile, serves every namespace.
#define STRING(x) #x
#define VALUE(x) STRING(x)
extern "C" const char hybrid_engine_ops_namespace[] = VALUE(HYBRID_ENGINE_OPS);
