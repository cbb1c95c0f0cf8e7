// The decode kernel compiled for avx2 (flags in setup.py); see decode.cpp.
#include "decode.cpp"
