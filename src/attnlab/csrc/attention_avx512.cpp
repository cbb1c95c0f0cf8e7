// The kernel compiled for avx512 (flags in setup.py); see attention.cpp.
#include "attention.cpp"
