bd="--kv-cache-dtype fp8 --kv-cache-memory-gb 4 --max-num-batched-tokens 65536 --kv-offloading-size 40 --lengths 512K --attention infinitehip:3k-flash --dense-lengths"
timeout 290 python3 -c "import sys; from longreach.cli import main; sys.exit(main(['bench','decode']+sys.argv[1:]))" $bd --out $OUT/ab-release.json > $OUT/ab-release.log 2>&1; echo A $?
timeout 290 python3 -c "import sys; import longreach.kvcache.offload as o; o.OffloadedKVCache.release_staging = lambda self: None; from longreach.cli import main; sys.exit(main(['bench','decode']+sys.argv[1:]))" $bd --out $OUT/ab-keep.json > $OUT/ab-keep.log 2>&1; echo B $?
for f in release keep; do grep "decode:.*prefill .* s, decode" $OUT/ab-$f.log; grep "captured" $OUT/ab-$f.log | tail -4; done
