#!/bin/sh
# Rebuilds plotly-custom.min.js: plotly.js's core (scatter) plus the bar and violin traces, the only ones
# web/static/app.js draws, bundled and minified with esbuild the way plotly.js builds its own bundles
# (CUSTOM_BUNDLE.md, esbuild-config.js). Needs node and npm (the registry), nothing else.
#
#     sh web/static/vendor/build-plotly.sh [PLOTLY_JS_VERSION]
#
# Why not a prebuilt partial bundle: plotly.js-cartesian-dist-min (1.5 MB) took about 800 ms to run in headless
# chromium on the 2-core development box, this one (1.2 MB) about 280 ms; plotly.js-basic-dist-min has no violin.
# Keep the version that of the plotly.js the plotly Python package bundles (plotly/package_data/plotly.min.js).
set -eu
VERSION=${1:-4.1.1}
ESBUILD=0.25.12
OUT=$(cd "$(dirname "$0")" && pwd)
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
cd "$WORK"
npm init -y >/dev/null
npm install --ignore-scripts --no-audit --no-fund --silent "plotly.js@$VERSION" "esbuild@$ESBUILD"
cat > entry.js <<'EOF'
var Plotly = require('plotly.js/lib/core');  // scatter and the components (axes, legend, hover, shapes...)
Plotly.register([require('plotly.js/lib/bar'), require('plotly.js/lib/violin')]);
module.exports = Plotly;
EOF
# esbuild-config.js's settings, less its plugins: CSS and GLSL are only for maplibre and the WebGL traces (the
# registry's require of maplibre's CSS, for map traces, becomes an empty module)
./node_modules/.bin/esbuild entry.js --bundle --minify --format=iife --global-name=Plotly --target=es2016 \
    --define:global=window --define:define.amd=false --alias:regl=@plotly/regl --loader:.css=empty \
    --legal-comments=eof \
    --banner:js="/*! plotly.js v$VERSION custom bundle: scatter, bar, violin (web/static/vendor/build-plotly.sh). Copyright 2012-2026, Plotly, Inc. MIT license */" \
    --outfile="$OUT/plotly-custom.min.js" --log-level=warning
cp node_modules/plotly.js/LICENSE "$OUT/plotly.js-LICENSE"
echo "$OUT/plotly-custom.min.js: plotly.js $VERSION, esbuild $ESBUILD, sha256 $(sha256sum "$OUT/plotly-custom.min.js" | cut -d' ' -f1)"
