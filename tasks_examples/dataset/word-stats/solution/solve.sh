#!/bin/bash
wc -w < /data/poem.txt | tr -d ' ' > /app/count.txt
tr -s ' \n' '\n' < /data/poem.txt | awk '{ print length, $0 }' | sort -rn | head -1 | cut -d' ' -f2 > /app/longest.txt
