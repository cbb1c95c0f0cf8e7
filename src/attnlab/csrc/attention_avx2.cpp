// The kernel compiled for avx2 (flags in setup.py); see attention.cpp.
#include "attention.cpp"
