L=/work/bins/hubcast-load
source /work/main/docs/benchmarks/shapes.sh
for round in $(seq 1 ${ROUNDS:-4}); do
  for b in fanout own; do fanout13 $b /work/bins/hubcast-$b 0 4; done
  for b in fanout own; do fanout13 $b /work/bins/hubcast-$b 0 16; done
done
