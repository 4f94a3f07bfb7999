export PYTHONPATH=/tmp/site LD_LIBRARY_PATH=/tmp/deb/usr/lib/x86_64-linux-gnu \
  SCHEDLAB_BLAS=/tmp/deb/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \
  OPENBLAS_NUM_THREADS=2 PYTHONUNBUFFERED=1 MPLBACKEND=Agg
