//! SVG plots for `--plot FILE.svg` (drawn with the `plotters` crate):
//!
//! - [`Chart::Speedup`]: speedup against ranks (log₂ axis), one line per series, measured
//!   lines solid with points, predicted ones dashed, and the ideal line `speedup = ranks /
//!   first ranks` for reference.
//! - [`Chart::Busbw`]: bus bandwidth (GB/s) against message size (log axis), one line per
//!   algorithm, `MPI_Allreduce`'s among them.
//! - [`Chart::Breakdown`]: the step broken into its phases (data wait, forward,
//!   backward, communication, optimizer), a stacked bar per configuration.
//!
//! [`write_svg`] lays out one or more charts side by side in one SVG file, written
//! atomically; callers check the path with `check_output_file` before any work.
//!
//! ```text
//! ringtrain sweep --np 1,2 --plot sweep.svg -- train --use-synthetic-data
//! mpirun -np 2 ringtrain bench allreduce --algorithms ring,mpi --plot busbw.svg
//! ```

use std::path::Path;

use plotters::coord::Shift;
use plotters::prelude::*;

use crate::error::{LauncherError, Result};

/// One series of points of a line chart.
#[derive(Debug, Clone, PartialEq)]
pub struct Line {
    /// Its legend.
    pub name: String,
    /// `(x, y)` in the chart's units.
    pub points: Vec<(f64, f64)>,
    /// Drawn dashed, without points: a prediction, not a measurement.
    pub predicted: bool,
}

/// One stacked bar: a configuration's step, split into phases.
#[derive(Debug, Clone, PartialEq)]
pub struct Bar {
    /// The configuration (`2 ranks`, `Pipeline-2rank`).
    pub label: String,
    /// Seconds per step of each phase, in the order of the chart's phase names.
    pub parts: Vec<f64>,
}

/// One chart of a plot.
#[derive(Debug, Clone, PartialEq)]
pub enum Chart {
    /// Speedup against ranks, with the ideal line.
    Speedup {
        /// The chart's title.
        title: String,
        /// Measured and predicted series; x = ranks, y = speedup.
        lines: Vec<Line>,
    },
    /// Bus bandwidth against message size.
    Busbw {
        /// The chart's title.
        title: String,
        /// One per algorithm; x = bytes, y = busbw in GB/s.
        lines: Vec<Line>,
    },
    /// The step's phases as stacked bars.
    Breakdown {
        /// The chart's title.
        title: String,
        /// The phases, bottom to top.
        phases: Vec<String>,
        /// One per configuration.
        bars: Vec<Bar>,
    },
}

/// The phases of [`ringtrain_train::StepBreakdown`], bottom to top, and their values.
pub fn breakdown_phases(b: &ringtrain_train::StepBreakdown) -> (Vec<String>, Vec<f64>) {
    let phases = [
        ("data wait", b.data_wait),
        ("forward", b.forward),
        ("backward", b.backward),
        ("communication", b.communication),
        ("optimizer", b.optimizer),
    ];
    (
        phases.iter().map(|(n, _)| n.to_string()).collect(),
        phases.iter().map(|(_, v)| *v).collect(),
    )
}

const CHART_SIZE: (u32, u32) = (640, 420);

/// Draws `charts` side by side into the SVG file `path` (written atomically; `flag`
/// names the option in errors).
pub fn write_svg(flag: &'static str, path: &Path, charts: &[Chart]) -> Result<()> {
    let svg = render_svg(charts).map_err(|reason| LauncherError::Plot {
        flag,
        path: path.to_path_buf(),
        reason,
    })?;
    ringtrain_train::outputs::write_atomically(path, svg.as_bytes(), "writing the plot")?;
    Ok(())
}

/// The SVG text of `charts` side by side.
pub fn render_svg(charts: &[Chart]) -> std::result::Result<String, String> {
    if charts.is_empty() {
        return Err("there is nothing to plot".to_string());
    }
    let mut svg = String::new();
    {
        let width = CHART_SIZE.0 * charts.len() as u32;
        let root = SVGBackend::with_string(&mut svg, (width, CHART_SIZE.1)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| e.to_string())?;
        let areas = root.split_evenly((1, charts.len()));
        for (chart, area) in charts.iter().zip(&areas) {
            draw(chart, area).map_err(|e| e.to_string())?;
        }
        root.present().map_err(|e| e.to_string())?;
    }
    Ok(svg)
}

type DrawResult = std::result::Result<(), Box<dyn std::error::Error>>;

fn draw<DB: DrawingBackend>(chart: &Chart, area: &DrawingArea<DB, Shift>) -> DrawResult
where
    DB::ErrorType: 'static,
{
    match chart {
        Chart::Speedup { title, lines } => speedup(area, title, lines),
        Chart::Busbw { title, lines } => busbw(area, title, lines),
        Chart::Breakdown {
            title,
            phases,
            bars,
        } => breakdown(area, title, phases, bars),
    }
}

/// The range `lo..hi` of `values`, widened to `min_span` and padded on top.
fn range_of(values: impl Iterator<Item = f64>, floor: f64) -> (f64, f64) {
    let (mut lo, mut hi) = (f64::INFINITY, f64::NEG_INFINITY);
    for v in values.filter(|v| v.is_finite()) {
        lo = lo.min(v);
        hi = hi.max(v);
    }
    if !lo.is_finite() {
        return (floor, floor * 2.0);
    }
    (lo.max(floor), hi.max(lo.max(floor) * 2.0))
}

fn color(i: usize) -> RGBColor {
    const COLORS: [RGBColor; 8] = [
        RGBColor(31, 119, 180),
        RGBColor(255, 127, 14),
        RGBColor(44, 160, 44),
        RGBColor(214, 39, 40),
        RGBColor(148, 103, 189),
        RGBColor(140, 86, 75),
        RGBColor(227, 119, 194),
        RGBColor(127, 127, 127),
    ];
    COLORS[i % COLORS.len()]
}

fn draw_lines<DB, CT>(
    chart: &mut ChartContext<'_, DB, CT>,
    lines: &[Line],
    first_color: usize,
) -> DrawResult
where
    DB: DrawingBackend,
    DB::ErrorType: 'static,
    CT: CoordTranslate<From = (f64, f64)>,
{
    for (i, line) in lines.iter().enumerate() {
        let c = color(first_color + i);
        let style = c.stroke_width(2);
        if line.predicted {
            chart
                .draw_series(DashedLineSeries::new(line.points.clone(), 6, 4, style))?
                .label(format!("{} (predicted)", line.name))
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], style));
        } else {
            chart
                .draw_series(LineSeries::new(line.points.clone(), style))?
                .label(line.name.clone())
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], style));
            chart.draw_series(line.points.iter().map(|&p| Circle::new(p, 3, c.filled())))?;
        }
    }
    Ok(())
}

/// A chart's frame: title, margins and label areas, the same on every chart.
fn frame<'a, 'b, DB: DrawingBackend>(
    area: &'a DrawingArea<DB, Shift>,
    title: &str,
) -> ChartBuilder<'a, 'b, DB> {
    let mut builder = ChartBuilder::on(area);
    builder
        .caption(title, ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60);
    builder
}

/// The legend of the series drawn so far, at `position`.
fn legend<'a, DB, CT>(
    chart: &mut ChartContext<'a, DB, CT>,
    position: SeriesLabelPosition,
) -> DrawResult
where
    DB: DrawingBackend + 'a,
    DB::ErrorType: 'static,
    CT: CoordTranslate,
{
    chart
        .configure_series_labels()
        .position(position)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()?;
    Ok(())
}

fn speedup<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    title: &str,
    lines: &[Line],
) -> DrawResult
where
    DB::ErrorType: 'static,
{
    let (x_lo, x_hi) = range_of(lines.iter().flat_map(|l| l.points.iter().map(|p| p.0)), 1.0);
    let base = lines
        .iter()
        .find(|l| !l.predicted)
        .or(lines.first())
        .and_then(|l| l.points.first())
        .map_or(x_lo, |p| p.0 / p.1.max(f64::MIN_POSITIVE));
    let ideal = |x: f64| x / base;
    let (y_lo, y_hi) = range_of(
        lines
            .iter()
            .flat_map(|l| l.points.iter().map(|p| p.1))
            .chain([ideal(x_lo), ideal(x_hi)]),
        1e-3,
    );
    // Both axes logarithmic: the ideal line is straight, and 2 to 1024 ranks fit.
    let mut chart = frame(area, title).build_cartesian_2d(
        (x_lo..x_hi).log_scale().base(2.0),
        (y_lo * 0.8..y_hi * 1.25).log_scale().base(2.0),
    )?;
    chart
        .configure_mesh()
        .x_desc("ranks")
        .y_desc("speedup")
        .x_label_formatter(&|x| whole_ranks(*x))
        .y_label_formatter(&|y| format!("{y:.2}"))
        .draw()?;
    let grey = RGBColor(150, 150, 150).stroke_width(1);
    let ideal_points: Vec<(f64, f64)> = log_points(x_lo, x_hi)
        .into_iter()
        .map(|x| (x, ideal(x)))
        .collect();
    chart
        .draw_series(DashedLineSeries::new(ideal_points, 3, 3, grey))?
        .label("ideal (linear)")
        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], grey));
    draw_lines(&mut chart, lines, 0)?;
    legend(&mut chart, SeriesLabelPosition::UpperLeft)
}

/// A tick label of the ranks axis: whole rank counts only (a log axis also ticks
/// between them).
fn whole_ranks(x: f64) -> String {
    if (x - x.round()).abs() < 1e-3 {
        format!("{}", x.round())
    } else {
        String::new()
    }
}

/// Points spread evenly on a log axis from `lo` to `hi` (so a straight line stays straight).
fn log_points(lo: f64, hi: f64) -> Vec<f64> {
    let n = 32;
    (0..=n)
        .map(|i| lo * (hi / lo).powf(i as f64 / n as f64))
        .collect()
}

fn human_bytes(b: f64) -> String {
    const UNITS: [(&str, f64); 3] = [("G", 1073741824.0), ("M", 1048576.0), ("K", 1024.0)];
    for (unit, size) in UNITS {
        if b >= size {
            return format!("{}{unit}", (b / size * 10.0).round() / 10.0);
        }
    }
    format!("{b:.0}")
}

fn busbw<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    title: &str,
    lines: &[Line],
) -> DrawResult
where
    DB::ErrorType: 'static,
{
    let (x_lo, x_hi) = range_of(lines.iter().flat_map(|l| l.points.iter().map(|p| p.0)), 1.0);
    let (_, y_hi) = range_of(
        lines.iter().flat_map(|l| l.points.iter().map(|p| p.1)),
        1e-3,
    );
    let mut chart = frame(area, title)
        .build_cartesian_2d((x_lo..x_hi).log_scale().base(2.0), 0.0..y_hi * 1.05)?;
    chart
        .configure_mesh()
        .x_desc("message size (bytes)")
        .y_desc("busbw (GB/s)")
        .x_label_formatter(&|x| human_bytes(*x))
        .draw()?;
    draw_lines(&mut chart, lines, 0)?;
    legend(&mut chart, SeriesLabelPosition::UpperLeft)
}

fn breakdown<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    title: &str,
    phases: &[String],
    bars: &[Bar],
) -> DrawResult
where
    DB::ErrorType: 'static,
{
    let total = |b: &Bar| b.parts.iter().filter(|v| v.is_finite()).sum::<f64>();
    let (_, y_hi) = range_of(bars.iter().map(total), 1e-6);
    let n = bars.len().max(1);
    let mut chart = ChartBuilder::on(area)
        .caption(title, ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        // Integer ranges are inclusive in plotters: `0..n - 1` holds n segments.
        .build_cartesian_2d((0..n - 1).into_segmented(), 0.0..y_hi * 1.6)?;
    let labels: Vec<String> = bars.iter().map(|b| b.label.clone()).collect();
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(n)
        .y_desc("seconds per step")
        .x_label_formatter(&|v| match v {
            SegmentValue::CenterOf(i) => labels.get(*i).cloned().unwrap_or_default(),
            _ => String::new(),
        })
        .draw()?;
    for (p, phase) in phases.iter().enumerate() {
        let c = color(p);
        let rects: Vec<Rectangle<(SegmentValue<usize>, f64)>> = bars
            .iter()
            .enumerate()
            .map(|(i, bar)| {
                let below: f64 = bar.parts[..p.min(bar.parts.len())]
                    .iter()
                    .filter(|v| v.is_finite())
                    .sum();
                let own = bar
                    .parts
                    .get(p)
                    .copied()
                    .filter(|v| v.is_finite())
                    .unwrap_or(0.0);
                let mut r = Rectangle::new(
                    [
                        (SegmentValue::Exact(i), below),
                        (SegmentValue::Exact(i + 1), below + own),
                    ],
                    c.filled(),
                );
                r.set_margin(0, 0, 12, 12);
                r
            })
            .collect();
        chart
            .draw_series(rects)?
            .label(phase.clone())
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 12, y + 5)], c.filled()));
    }
    legend(&mut chart, SeriesLabelPosition::UpperRight)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn line(name: &str, points: &[(f64, f64)], predicted: bool) -> Line {
        Line {
            name: name.into(),
            points: points.to_vec(),
            predicted,
        }
    }

    #[test]
    fn a_speedup_chart_names_every_series_and_the_ideal_line() {
        let svg = render_svg(&[Chart::Speedup {
            title: "NMT scaling".into(),
            lines: vec![
                line("measured", &[(1.0, 1.0), (2.0, 1.8), (4.0, 3.1)], false),
                line(
                    "replicated",
                    &[(4.0, 3.1), (64.0, 30.0), (1024.0, 200.0)],
                    true,
                ),
            ],
        }])
        .unwrap();
        assert!(svg.starts_with("<svg"), "{}", &svg[..svg.len().min(80)]);
        for text in [
            "NMT scaling",
            "measured",
            "replicated (predicted)",
            "ideal (linear)",
            "ranks",
            "speedup",
        ] {
            assert!(svg.contains(text), "the plot lacks `{text}`");
        }
        // Three measured points drawn as circles.
        assert_eq!(svg.matches("<circle").count(), 3, "{svg}");
    }

    #[test]
    fn a_busbw_chart_has_a_line_per_algorithm() {
        let svg = render_svg(&[Chart::Busbw {
            title: "all-reduce, 2 ranks".into(),
            lines: vec![
                line("ring", &[(4096.0, 0.5), (1048576.0, 8.0)], false),
                line("mpi", &[(4096.0, 0.7), (1048576.0, 4.0)], false),
            ],
        }])
        .unwrap();
        for text in ["ring", "mpi", "busbw (GB/s)", "message size"] {
            assert!(svg.contains(text), "the plot lacks `{text}`");
        }
        assert!(svg.matches("<polyline").count() >= 2, "{svg}");
    }

    #[test]
    fn a_breakdown_chart_stacks_a_bar_per_configuration() {
        let (phases, parts) = breakdown_phases(&ringtrain_train::StepBreakdown {
            data_wait: 0.01,
            forward: 0.2,
            backward: 0.4,
            communication: 0.1,
            optimizer: 0.05,
        });
        let bars = vec![
            Bar {
                label: "1 rank".into(),
                parts: parts.clone(),
            },
            Bar {
                label: "2 ranks".into(),
                parts,
            },
        ];
        let svg = render_svg(&[Chart::Breakdown {
            title: "step".into(),
            phases: phases.clone(),
            bars,
        }])
        .unwrap();
        for text in phases
            .iter()
            .map(String::as_str)
            .chain(["1 rank", "2 ranks"])
        {
            assert!(svg.contains(text), "the plot lacks `{text}`");
        }
        // Five phases stacked on two bars, plus five legend swatches.
        assert!(svg.matches("<rect").count() >= 15, "{svg}");
    }

    #[test]
    fn charts_side_by_side_widen_the_file_and_nothing_to_plot_is_an_error() {
        let one = Chart::Speedup {
            title: "a".into(),
            lines: vec![line("m", &[(1.0, 1.0), (2.0, 2.0)], false)],
        };
        let svg = render_svg(&[one.clone(), one]).unwrap();
        assert!(
            svg.contains(&format!("width=\"{}\"", CHART_SIZE.0 * 2)),
            "{}",
            &svg[..200]
        );
        assert!(render_svg(&[]).unwrap_err().contains("nothing to plot"));
    }
}
