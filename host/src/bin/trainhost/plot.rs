//! `trainhost metrics --plot`: the chosen metrics against the report
//! index, one panel and line per metric, the reports that committed a
//! checkpoint marked with a dot. PNG or SVG by the file's extension.

use std::path::Path;

use anyhow::{Context, bail};
use plotters::coord::Shift;
use plotters::prelude::*;
use trainhost::ReportRecord;

/// The font every label is drawn with, built in so that a plot looks the
/// same everywhere (DejaVu Sans; its license is beside it).
static FONT: &[u8] = include_bytes!("../../../assets/DejaVuSans.ttf");

const WIDTH: u32 = 960;
/// Line colours that stay readable on white (matplotlib's "tab10").
const COLORS: [RGBColor; 10] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
    RGBColor(188, 189, 34),
    RGBColor(23, 190, 207),
];
/// The height of one metric's panel.
const PANEL: u32 = 240;

/// A point of a series: the report index, the value, and whether the
/// report committed a checkpoint.
type Point = (u64, f64, bool);
/// A metric's name and its points.
type Series<'a> = (&'a str, Vec<Point>);

/// Draw `metrics` of `history` into `path` (`.png` or `.svg`).
pub fn plot(
    path: &Path,
    title: &str,
    history: &[ReportRecord],
    metrics: &[String],
) -> anyhow::Result<()> {
    let series: Vec<Series> = metrics
        .iter()
        .map(|m| {
            let points = history
                .iter()
                .filter_map(|r| {
                    let v = r.metrics.get(m)?.as_f64()?;
                    v.is_finite()
                        .then_some((r.report_index, v, r.checkpoint.is_some()))
                })
                .collect();
            (m.as_str(), points)
        })
        .filter(|(_, points): &Series| !points.is_empty())
        .collect();
    if series.is_empty() {
        bail!(
            "none of {} has a finite numeric value to plot",
            metrics.join(", ")
        );
    }
    plotters::style::register_font("sans-serif", FontStyle::Normal, FONT)
        .map_err(|_| anyhow::anyhow!("the built-in font does not load"))?;
    let size = (WIDTH, PANEL * series.len() as u32 + 40);
    let extension = path
        .extension()
        .and_then(|e| e.to_str())
        .unwrap_or_default();
    match extension.to_ascii_lowercase().as_str() {
        "png" => {
            let root = BitMapBackend::new(path, size).into_drawing_area();
            draw(&root, title, &series)?;
            root.present()
                .with_context(|| format!("cannot write {}", path.display()))?;
        }
        "svg" => {
            let root = SVGBackend::new(path, size).into_drawing_area();
            draw(&root, title, &series)?;
            root.present()
                .with_context(|| format!("cannot write {}", path.display()))?;
        }
        _ => bail!(
            "cannot plot into {}: name a .png or .svg file",
            path.display()
        ),
    }
    Ok(())
}

fn draw<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    title: &str,
    series: &[Series],
) -> anyhow::Result<()>
where
    DB::ErrorType: 'static,
{
    let err = |e: DrawingAreaErrorKind<DB::ErrorType>| anyhow::anyhow!("cannot draw the plot: {e}");
    root.fill(&WHITE).map_err(err)?;
    let root = root.titled(title, ("sans-serif", 20)).map_err(err)?;
    let last = series
        .iter()
        .flat_map(|(_, p)| p.iter().map(|p| p.0))
        .max()
        .unwrap_or(0);
    for (i, (panel, (name, points))) in root
        .split_evenly((series.len(), 1))
        .iter()
        .zip(series)
        .enumerate()
    {
        let (lo, hi) = points
            .iter()
            .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), p| {
                (lo.min(p.1), hi.max(p.1))
            });
        // A flat series still gets a band to sit in.
        let pad = ((hi - lo) * 0.05).max(hi.abs().max(1.0) * 1e-3);
        let color = COLORS[i % COLORS.len()];
        let mut chart = ChartBuilder::on(panel)
            .margin(8)
            .x_label_area_size(28)
            .y_label_area_size(70)
            .caption(*name, ("sans-serif", 16))
            .build_cartesian_2d(0u64..last.max(1), (lo - pad)..(hi + pad))
            .map_err(err)?;
        chart
            .configure_mesh()
            .x_desc("report")
            .label_style(("sans-serif", 12))
            .light_line_style(WHITE.mix(0.0))
            .draw()
            .map_err(err)?;
        chart
            .draw_series(LineSeries::new(
                points.iter().map(|p| (p.0, p.1)),
                color.stroke_width(2),
            ))
            .map_err(err)?
            .label(*name)
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 16, y)], color.stroke_width(2)));
        chart
            .draw_series(
                points
                    .iter()
                    .filter(|p| p.2)
                    .map(|p| Circle::new((p.0, p.1), 4, BLACK.filled())),
            )
            .map_err(err)?
            .label("checkpoint")
            .legend(|(x, y)| Circle::new((x + 8, y), 4, BLACK.filled()));
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK.mix(0.3))
            .label_font(("sans-serif", 12))
            .draw()
            .map_err(err)?;
    }
    Ok(())
}
