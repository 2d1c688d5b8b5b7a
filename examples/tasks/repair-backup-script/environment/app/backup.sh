#!/bin/bash
set -e
mkdir -p backup
cp datas/*.txt backup/
